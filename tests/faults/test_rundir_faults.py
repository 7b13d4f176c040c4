"""Faults of the run directory (issue 20): a full disk, a FIFO, a read-only or deleted directory, an earlier
run's files and another run's side file, each with real processes, real mounts and real files.

Every Monitor here runs in a child process with a timeout, so that a SIGBUS or a hang is a failed
assertion on the child's exit, not a dead test runner. Mounts need root; a refused mount skips with the
reason.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankmem.cli._relay import StderrRelay
from rankmem.core.rundir import NotRegularFile, RunDir, current_run_id, open_regular
from rankmem.forensics.heartbeat import heartbeat_run_id
from rankmem.offline import read_run
from tests.conftest import REPO
from tests.runlog_helpers import known_run

CHILD_TIMEOUT_S = 60


def _child(body: str, timeout: float = CHILD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (with ``import rankmem`` done) in a fresh interpreter; warnings go to stderr."""
    code = "import warnings, rankmem\nwarnings.simplefilter('always')\n" + textwrap.dedent(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANKMEM_RUN_ID", "RANKMEM_HEARTBEAT_DIR", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


def _steps(out: Path, n: int = 3, extra: str = "") -> str:
    return f"""
        m = rankmem.Monitor(out_dir={str(out)!r}, device="cpu", children=False, leak_check=False)
        for s in range({n}):
            with m.step(s):
                pass
            m.collect({{"loss": float(s)}})
            {extra or "pass"}
        m.close()
        print("done")
    """


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own (as root), unmounted at the end."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=200", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(mount: Path) -> None:
    """Every block of the file system taken: the next block any write needs is refused (ENOSPC)."""
    with open(mount / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    assert os.statvfs(mount).f_bavail == 0


def test_a_full_disk_costs_warnings_never_the_process(tmpfs: Path) -> None:
    out = tmpfs / "run"
    out.mkdir()  # the directory exists (an inode is free): every file in it needs a block that is not
    _fill(tmpfs)
    done = _child(_steps(out, 3, "m.record_oom(MemoryError())"))
    # Before: the heartbeat's mapped hole took SIGBUS at its first store (exit -7, inside the constructor).
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    assert "cannot write the heartbeat" in done.stderr and "No space left on device" in done.stderr
    assert "cannot write events" in done.stderr
    assert "sink JsonlSink failed in open()" in done.stderr


def test_a_read_only_run_directory_costs_warnings_never_the_process(tmpfs: Path) -> None:
    out = tmpfs / "run"
    out.mkdir()
    ro = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True)
    if ro.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only ({ro.stderr.strip()})")
    done = _child(_steps(out, 3, "m.record_oom(MemoryError())"))
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    assert "Read-only file system" in done.stderr and "cannot write the heartbeat" in done.stderr


@pytest.mark.parametrize("where", ["events/rank0.jsonl", "heartbeat/rank0.hb", "rankmem.jsonl"])
def test_a_fifo_where_a_file_belongs_never_blocks(tmp_path: Path, where: str) -> None:
    out = tmp_path / "run"
    fifo = out / where
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    # Before: open(O_WRONLY) of a FIFO with no reader blocked the training thread forever at the OOM.
    done = _child(_steps(out, 2, "m.record_oom(MemoryError())"), timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    if where == "rankmem.jsonl":  # an earlier run's "log" is moved aside like any other; the new log is a file
        assert (out / "rankmem.jsonl.1").is_fifo() and read_run(str(out)).steps.tolist() == [0, 1]
    else:
        assert "not a regular file (a FIFO)" in done.stderr or (out / where).is_file(), done.stderr[-2000:]


def test_a_run_directory_deleted_mid_run_is_said_not_written_to_an_unlinked_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    body = _steps(out, 4, f"m.flush(10); __import__('shutil').rmtree({str(out)!r}) if s == 1 else None")
    done = _child(body)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    assert done.stderr.count("was deleted while the run wrote it") == 1, done.stderr[-2000:]
    assert "the run log stops here" in done.stderr


def _ids(path: Path) -> str | None:
    return json.loads(path.read_text().splitlines()[0]).get("run_id")


def test_restarts_rotate_every_file_of_a_run_with_one_number(tmp_path: Path) -> None:
    """Three library runs into one out_dir: the log, side file, events and heartbeats of each earlier
    run share one number, and each log reads with its own side file."""
    out = tmp_path / "run"
    oom = "m.record_oom(MemoryError()) if s == 0 else None"
    assert _child(_steps(out, 6, oom)).returncode == 0
    assert _child(_steps(out, 2, oom)).returncode == 0
    third = _child(_steps(out, 14, oom))
    assert third.returncode == 0, third.stderr[-2000:]
    assert "rotated it to" in third.stderr
    for n, steps in ((1, 6), (2, 2)):
        log = out / f"rankmem.jsonl.{n}"
        run_id = _ids(log)
        assert run_id and _ids(out / f"events.{n}" / "rank0.jsonl") == run_id
        assert (out / f"heartbeat.{n}" / "rank0.hb").exists()
        run = read_run(str(log))
        assert run.steps.size == steps and run.detail_note is None
    assert (out / "rankmem.ranks.f64.2").exists()
    assert read_run(str(out)).steps.size == 14 and _ids(out / "events" / "rank0.jsonl") == _ids(out / "rankmem.jsonl")


def test_a_rank_rotating_while_another_moves_the_same_run_aside_takes_the_same_number(tmp_path: Path) -> None:
    """After a torchrun restart each rank rotates its own files as it starts, the logging rank the rest:
    one rank's rotation made ``heartbeat.1`` and had not yet moved a file in when the other chose its
    number, and took 2 (the restart test's rank 1 events in ``events.2``, once in a loaded run)."""
    run = RunDir(str(tmp_path))
    old = "0123456789abcdef"
    os.makedirs(run.events)
    (tmp_path / "events" / "rank1.jsonl").write_text(json.dumps({"kind": "oom", "run_id": old}) + "\n")
    os.makedirs(f"{run.heartbeat}.1")  # the other rank's rotation of the same run, under way
    moved = run.rotate("fedcba9876543210", heartbeat_run_id, only=[os.path.join(run.events, "rank1.jsonl")])
    assert [os.path.relpath(m.to, tmp_path) for m in moved] == [os.path.join("events.1", "rank1.jsonl")]
    # A slot that holds another run's files is not taken.
    (tmp_path / "events" / "rank0.jsonl").write_text(json.dumps({"kind": "oom", "run_id": "1111111111111111"}) + "\n")
    moved = run.rotate("fedcba9876543210", heartbeat_run_id, only=[os.path.join(run.events, "rank0.jsonl")])
    assert [os.path.relpath(m.to, tmp_path) for m in moved] == [os.path.join("events.2", "rank0.jsonl")]


def test_a_side_file_of_another_run_is_named_not_read(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert _child(_steps(a, 14)).returncode == 0 and _child(_steps(b, 6)).returncode == 0
    shutil.copy(a / "rankmem.ranks.f64", b / "rankmem.ranks.f64")  # same world size, another run
    run = read_run(str(b))
    assert run.detail_note is not None and "is from another run" in run.detail_note
    assert run.steps.size == 0 and run.logged is not None and run.logged.steps.tolist() == list(range(6))


def test_the_run_id_is_shared_by_an_attempts_ranks_and_new_for_each_restart() -> None:
    env = {"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = current_run_id(env)
    assert first == current_run_id(dict(env)) and len(first) == 16
    assert current_run_id({**env, "TORCHELASTIC_RESTART_COUNT": "1"}) != first
    assert current_run_id({"RANKMEM_RUN_ID": "x"}) != current_run_id({"RANKMEM_RUN_ID": "y"})


def test_a_plain_file_where_a_directory_belongs_is_moved_aside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "heartbeat").write_text("not a directory")
    done = _child(_steps(out, 2))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "heartbeat.1").read_text() == "not a directory" and (out / "heartbeat" / "rank0.hb").is_file()
    assert RunDir(str(out)).heartbeat == str(out / "heartbeat")


# ---- links and devices where rankmem writes: never followed, never replaced ------------------------------

def test_links_planted_in_the_run_directory_are_never_followed(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (out / "events").mkdir(parents=True)
    (out / "heartbeat").mkdir()
    elsewhere.mkdir()
    planted = {".lock": b"precious lock target\n" * 20, "events/rank0.jsonl": b'{"precious": 1}\n',
               "heartbeat/rank0.hb": b"precious heartbeat" * 10, "rankmem.ranks.f64": b"precious side",
               "torchrun.log": b"precious launch log\n"}
    for i, (name, data) in enumerate(planted.items()):
        (elsewhere / str(i)).write_bytes(data)
        os.symlink(elsewhere / str(i), out / name)
    done = _child(_steps(out, 3, "m.record_oom(MemoryError()) if s == 0 else None"))
    assert done.returncode == 0, done.stderr[-2000:]
    for i, data in enumerate(planted.values()):
        assert (elsewhere / str(i)).read_bytes() == data  # byte for byte
    assert ".lock is a symbolic link: removed (its target untouched)" in done.stderr
    run = read_run(str(out))
    assert run.steps.tolist() == [0, 1, 2] and run.series["loss"][:, 0].tolist() == [0.0, 1.0, 2.0]
    assert not (out / "rankmem.ranks.f64").is_symlink() and any(p.is_symlink() for p in out.glob("rankmem.ranks.f64.*"))
    assert not (out / "events" / "rank0.jsonl").is_symlink()  # moved aside as an earlier run's, a new one written
    # The launch log: a new launch moves it aside with the run's other files; a link made after that is
    # refused by the launcher's relay, which goes on without a launch log.
    moved = RunDir(str(out)).rotate(None, heartbeat_run_id)
    assert str(out / "torchrun.log") in [m.path for m in moved]
    os.symlink(elsewhere / "4", out / "torchrun.log")
    read, write = os.pipe()
    with open(read, "rb") as source, open(os.devnull, "w") as sink:
        relay = StderrRelay(source, sink, str(out / "torchrun.log"))
        os.write(write, b"a line of a rank\n")
        os.close(write)
        relay.close()
        assert relay.log_path is None
    assert (elsewhere / "4").read_bytes() == planted["torchrun.log"]
    with pytest.raises(NotRegularFile, match="is a symbolic link"):
        open_regular(str(out / "torchrun.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)


@pytest.mark.parametrize("name", ["rankmem.jsonl", "rankmem.ranks.f64", "events/rank0.jsonl"])
def test_an_empty_file_hard_linked_in_is_not_written_through(tmp_path: Path, name: str) -> None:
    """An empty file where a run writes looks like one a rank has just created, unless it has other names."""
    out, target = tmp_path / "run", tmp_path / "elsewhere"
    (out / "events").mkdir(parents=True)
    target.write_bytes(b"")
    os.link(target, out / name)
    done = _child(_steps(out, 3, "m.record_oom(MemoryError()) if s == 0 else None"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert target.read_bytes() == b"" and os.stat(target).st_nlink == 2  # moved aside, not written to
    assert read_run(str(out)).steps.tolist() == [0, 1, 2]


def _device(path: Path) -> None:
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is, made here
    except PermissionError as exc:
        pytest.skip(f"cannot make a device node here ({exc}): needs root or CAP_MKNOD")


@pytest.mark.parametrize("flag", ["--html", "-o"])
def test_a_page_or_plot_onto_a_device_is_one_error_and_the_node_stays(tmp_path: Path, flag: str) -> None:
    known_run(tmp_path / "run")
    node = tmp_path / "node"
    _device(node)
    command = ["report", str(tmp_path / "run"), "--html", str(node)] if flag == "--html" else \
        ["plot", str(tmp_path / "run"), "-o", str(node)]
    done = subprocess.run([sys.executable, "-m", "rankmem", *command], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "is a character device" in done.stderr and "Traceback" not in done.stderr
    assert stat.S_ISCHR(os.lstat(node).st_mode)


@pytest.mark.parametrize(("umask", "mode"), [("077", 0o600), ("022", 0o644)])
def test_a_page_takes_its_mode_from_the_umask(tmp_path: Path, umask: str, mode: int) -> None:
    known_run(tmp_path / "run")
    page = tmp_path / "page.html"
    done = subprocess.run(["sh", "-c", f'umask {umask} && exec "$0" -m rankmem report "$1" --html "$2"',
                           sys.executable, str(tmp_path / "run"), str(page)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(os.stat(page).st_mode) == mode
    os.chmod(page, 0o640)  # a page written over keeps the mode its owner gave it
    done = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path / "run"), "--html", str(page)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and stat.S_IMODE(os.stat(page).st_mode) == 0o640


def test_a_second_launch_keeps_the_first_launch_log_beside_its_run_log(tmp_path: Path) -> None:
    assert _child(_steps(tmp_path, 2)).returncode == 0
    (tmp_path / "torchrun.log").write_text("[rank1]: Traceback (most recent call last): the first launch's\n")
    first = (tmp_path / "rankmem.jsonl").read_bytes()
    moved = RunDir(str(tmp_path)).rotate(None, heartbeat_run_id)  # what rankmem train does before a launch
    assert {os.path.basename(m.to) for m in moved} >= {"rankmem.jsonl.1", "rankmem.ranks.f64.1", "torchrun.log.1"}
    assert (tmp_path / "torchrun.log.1").read_text().startswith("[rank1]: Traceback")
    assert (tmp_path / "rankmem.jsonl.1").read_bytes() == first and not (tmp_path / "torchrun.log").exists()
