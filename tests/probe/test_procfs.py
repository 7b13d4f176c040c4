"""Parsers fed fixed /proc and cgroup text: odd fields, missing fields, v1/v2/no-limit cgroups."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankmem.probe import procfs as _procfs

STATUS = b"""Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
VmPeak:\t 1234567 kB
VmSize:\t 1200000 kB
VmHWM:\t  524288 kB
VmRSS:\t  262144 kB
RssAnon:\t  200000 kB
"""


def test_statm_rss_in_pages() -> None:
    assert _procfs.parse_statm_rss(b"51234 1000 300 10 0 4000 0\n", 4096) == 1000 * 4096
    assert _procfs.parse_statm_rss(b"51234 1000", 65536) == 1000 * 65536  # 64 KiB pages (arm64)


def test_statm_rss_garbage_is_unavailable() -> None:
    assert _procfs.parse_statm_rss(b"", 4096) is None
    assert _procfs.parse_statm_rss(b"12", 4096) is None
    assert _procfs.parse_statm_rss(b"12 x 3", 4096) is None


def test_status_kb_fields() -> None:
    assert _procfs.parse_kb_field(STATUS, b"VmHWM") == 524288 * 1024
    assert _procfs.parse_kb_field(STATUS, b"VmRSS") == 262144 * 1024
    # The first line has no leading newline; a prefix of another name must not match.
    assert _procfs.parse_kb_field(b"VmHWM: 8 kB\nVmRSS: 4 kB", b"VmHWM") == 8 * 1024
    assert _procfs.parse_kb_field(STATUS, b"VmHW") is None


def test_status_missing_and_odd_fields() -> None:
    assert _procfs.parse_kb_field(STATUS, b"VmSwap") is None  # absent (kernel without swap accounting)
    assert _procfs.parse_kb_field(b"VmHWM:\n", b"VmHWM") is None  # empty value
    assert _procfs.parse_kb_field(b"VmHWM: lots kB\n", b"VmHWM") is None
    assert _procfs.parse_kb_field(b"Threads:\t7\n", b"Threads") == 7  # a count, no unit


def test_status_rss_hwm_fast_path() -> None:
    assert _procfs.parse_status_rss_hwm(STATUS) == (262144 * 1024, 524288 * 1024)
    assert _procfs.parse_status_rss_hwm(b"Name:\tkthreadd\nState:\tS\n") == (None, None)  # kernel thread
    assert _procfs.parse_status_rss_hwm(b"x\nVmHWM:\t bad kB\nVmRSS:\t 4 kB\n") == (4096, None)


def test_meminfo_total_available() -> None:
    data = b"MemTotal:       24683304 kB\nMemFree:        20000000 kB\nMemAvailable:   22000000 kB\n"
    assert _procfs.parse_meminfo(data) == (24683304 * 1024, 22000000 * 1024)


def test_meminfo_without_memavailable_before_linux_3_14() -> None:
    data = b"MemTotal:       24683304 kB\nMemFree:        20000000 kB\nBuffers: 10 kB\n"
    assert _procfs.parse_meminfo(data) == (24683304 * 1024, None)


def test_children_list() -> None:
    assert _procfs.parse_children(b"101 102 7\n") == [101, 102, 7]
    assert _procfs.parse_children(b"") == []


def test_cgroup_limit_values() -> None:
    assert _procfs.parse_cgroup_limit(b"max\n") is None
    assert _procfs.parse_cgroup_limit(b"9223372036854771712\n") is None  # v1 "unlimited"
    assert _procfs.parse_cgroup_limit(b"4294967296\n") == 4 << 30
    assert _procfs.parse_cgroup_limit(b"") is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_found_under_its_path(tmp_path: Path) -> None:
    base = tmp_path / "system.slice" / "job.scope"
    _write(base / "memory.current", "1048576\n")
    _write(base / "memory.max", "2147483648\n")
    files = _procfs.find_cgroup_files("0::/system.slice/job.scope\n", root=str(tmp_path))
    assert files is not None and files.version == 2
    assert files.current == str(base / "memory.current")
    assert _procfs.parse_cgroup_limit(Path(files.limit).read_bytes()) == 2 << 30


def test_cgroup_v2_namespaced_container_uses_mount_root(tmp_path: Path) -> None:
    _write(tmp_path / "memory.current", "5\n")
    _write(tmp_path / "memory.max", "max\n")
    files = _procfs.find_cgroup_files("0::/\n", root=str(tmp_path))
    assert files is not None and files.version == 2
    assert _procfs.parse_cgroup_limit(Path(files.limit).read_bytes()) is None  # no limit


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    base = tmp_path / "memory" / "docker" / "abc"
    _write(base / "memory.usage_in_bytes", "3000\n")
    _write(base / "memory.limit_in_bytes", "8589934592\n")
    text = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n"
    files = _procfs.find_cgroup_files(text, root=str(tmp_path))
    assert files is not None and files.version == 1
    assert files.current == str(base / "memory.usage_in_bytes")


@pytest.mark.parametrize("version", [1, 2])
def test_the_tightest_limit_on_the_path_to_the_root_is_the_one_that_counts(tmp_path: Path, version: int) -> None:
    # job (4 GiB) > step (1 GiB) > task (unlimited): the step's limit is where the OOM killer acts.
    mount = tmp_path / "memory" if version == 1 else tmp_path
    current, limit = ("memory.usage_in_bytes", "memory.limit_in_bytes") if version == 1 else ("memory.current",
                                                                                            "memory.max")
    unlimited = "9223372036854771712\n" if version == 1 else "max\n"
    for path, value in (("job", f"{4 << 30}\n"), ("job/step", f"{1 << 30}\n"), ("job/step/task", unlimited)):
        _write(mount / path / current, "1000\n")
        _write(mount / path / limit, value)
    _write(mount / current, "5000\n")  # the hierarchy's root: no limit file, as on a host
    text = "4:memory:/job/step/task\n0::/\n" if version == 1 else "0::/job/step/task\n"
    files = _procfs.find_cgroup_files(text, root=str(tmp_path))
    assert files is not None and files.version == version and files.dir == str(mount / "job" / "step")
    assert _procfs.parse_cgroup_limit(Path(files.limit).read_bytes()) == 1 << 30
    own = _procfs.find_cgroup_files(text, root=str(tmp_path), tightest=False)
    assert own is not None and own.dir == str(mount / "job" / "step" / "task")


def test_no_cgroup_files_is_none(tmp_path: Path) -> None:
    assert _procfs.find_cgroup_files("3:memory:/x\n0::/y\n", root=str(tmp_path)) is None
    assert _procfs.find_cgroup_files("garbage\n", root=str(tmp_path)) is None


# ---- the near-OOM watch's sources --------------------------------------------------------------------
V2_EVENTS = b"low 0\nhigh 12\nmax 40\noom 3\noom_kill 2\noom_group_kill 0\n"
V1_OOM_CONTROL = b"oom_kill_disable 0\nunder_oom 1\noom_kill 5\n"
V1_STAT = b"cache 2150400\nrss 1937408\ninactive_file 1540096\ntotal_cache 9000000\ntotal_inactive_file 8000000\n"
V2_STAT = b"anon 104857600\nfile 52428800\ninactive_file 41943040\nactive_file 10485760\n"
PSI = b"some avg10=12.50 avg60=3.10 avg300=0.75 total=123456\nfull avg10=4.00 avg60=1.00 avg300=0.20 total=6543\n"


def test_keyed_files() -> None:
    assert _procfs.parse_keyed(V2_EVENTS)["oom_kill"] == 2
    assert _procfs.parse_keyed(V1_OOM_CONTROL) == {"oom_kill_disable": 0, "under_oom": 1, "oom_kill": 5}
    assert _procfs.parse_keyed(b"nr_free_pages 12\noom_kill 7\n")["oom_kill"] == 7  # /proc/vmstat
    assert _procfs.parse_keyed(b"a 1 2\nb x\n\nc 3") == {"c": 3}
    # Linux < 4.13: v1 oom_control has no oom_kill line.
    assert "oom_kill" not in _procfs.parse_keyed(b"oom_kill_disable 0\nunder_oom 0\n")


def test_inactive_file_prefers_v1_hierarchical_total() -> None:
    assert _procfs.inactive_file(_procfs.parse_keyed(V1_STAT)) == 8000000
    assert _procfs.inactive_file(_procfs.parse_keyed(V2_STAT)) == 41943040
    assert _procfs.inactive_file({}) is None


def test_working_set_is_usage_minus_inactive_file() -> None:
    # v1: usage_in_bytes counts child cgroups, so the hierarchical total_inactive_file goes with it.
    assert _procfs.working_set(20_000_000, V1_STAT) == 20_000_000 - 8_000_000
    assert _procfs.working_set(150_000_000, V2_STAT) == 150_000_000 - 41943040
    assert _procfs.working_set(1_000_000, V2_STAT) == 0  # never negative (the two reads are not atomic)
    assert _procfs.working_set(5, b"anon 5\n") is None  # no inactive-file figure: unknown, not usage


def test_pressure_lines() -> None:
    p = _procfs.parse_pressure(PSI)
    assert p is not None and p.some is not None and p.full is not None
    assert (p.some.avg10, p.some.avg60, p.some.avg300, p.some.total_us) == (12.5, 3.1, 0.75, 123456)
    assert p.full.avg10 == 4.0
    # The system-wide CPU file has no "full" line before Linux 5.13; odd lines are skipped.
    only_some = _procfs.parse_pressure(b"some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull garbage\n")
    assert only_some is not None and only_some.full is None and only_some.some is not None
    assert _procfs.parse_pressure(b"") is None
    assert _procfs.parse_pressure(b"some avg10=x avg60=0 avg300=0 total=0\n") is None


def test_uss_from_smaps_rollup() -> None:
    rollup = (b"563041d35000-7fff407e1000 ---p 00000000 00:00 0                          [rollup]\n"
              b"Rss:                1852 kB\nPss:                 324 kB\nShared_Clean:       1408 kB\n"
              b"Private_Clean:       292 kB\nPrivate_Dirty:       152 kB\nPrivate_Hugetlb:       0 kB\n")
    assert _procfs.parse_uss(rollup) == (292 + 152) * 1024
    assert _procfs.parse_uss(b"Rss: 4 kB\n") is None  # a kernel thread's empty rollup


def test_stat_starttime_survives_odd_command_names() -> None:
    fields = " ".join(str(n) for n in range(3, 23))  # fields 3..22; field 22 (starttime) is "22"
    assert _procfs.parse_stat_starttime(f"123 (python) {fields} 23 24".encode()) == 22
    assert _procfs.parse_stat_starttime(f"123 (a) b (c)) {fields}".encode()) == 22
    assert _procfs.parse_stat_starttime(b"123 (python) S 1") is None
    assert _procfs.parse_stat_starttime(b"garbage") is None


def test_stat_state() -> None:
    assert _procfs.parse_stat_state(b"123 (python) T 1 123 123 0") == "T"
    assert _procfs.parse_stat_state(b"123 (a) R (b)) D 1") == "D"
    assert _procfs.parse_stat_state(b"123 (python)") is None
    assert _procfs.parse_stat_state(b"") is None


def test_descendants_walk_every_thread(tmp_path: Path) -> None:
    _write(tmp_path / "10" / "task" / "10" / "children", "11 12")
    _write(tmp_path / "10" / "task" / "15" / "children", "13\n")  # a child forked by another thread
    _write(tmp_path / "11" / "task" / "11" / "children", "14")
    _write(tmp_path / "14" / "task" / "14" / "children", "")
    assert _procfs.descendants(10, str(tmp_path)) == {11, 12, 13, 14}
    assert _procfs.descendants(99, str(tmp_path)) == set()


def test_cgroup_dir_and_own_cgroup(tmp_path: Path) -> None:
    base = tmp_path / "cg" / "memory" / "docker" / "abc"
    _write(base / "memory.usage_in_bytes", "3000\n")
    _write(base / "memory.limit_in_bytes", "8589934592\n")
    _write(tmp_path / "proc" / "self" / "cgroup", "3:memory:/docker/abc\n0::/\n")
    files = _procfs.own_cgroup_files(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert files is not None and files.version == 1 and files.dir == str(base)
    assert _procfs.own_cgroup_files(str(tmp_path / "nowhere"), str(tmp_path / "cg")) is None
