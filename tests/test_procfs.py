"""Parsers fed fixed /proc and cgroup text: odd fields, missing fields, v1/v2/no-limit cgroups."""

from __future__ import annotations

from pathlib import Path

from rankmem import _procfs

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


def test_no_cgroup_files_is_none(tmp_path: Path) -> None:
    assert _procfs.find_cgroup_files("3:memory:/x\n0::/y\n", root=str(tmp_path)) is None
    assert _procfs.find_cgroup_files("garbage\n", root=str(tmp_path)) is None
