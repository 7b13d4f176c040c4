"""A scratch memory cgroup for tests that need the real kernel: created under this process's own memory
cgroup, removed afterwards; the test skips, with the reason, where the machine refuses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankmem.probe import procfs as _procfs


@contextlib.contextmanager
def scratch_memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """``<own memory cgroup>/rankmem-test-<pid>-<n>`` with ``limit_bytes``; its processes are killed and
    the directory removed on exit. v1 (``memory.limit_in_bytes``) or v2 (``memory.max``)."""
    if os.geteuid() != 0:
        pytest.skip("a scratch memory cgroup needs root")
    own = _procfs.own_cgroup_files(tightest=False)
    if own is None:
        pytest.skip("this process has no memory cgroup (no v2 memory.current, no v1 memory controller)")
    limit_name = "memory.max" if own.version == 2 else "memory.limit_in_bytes"
    path = Path(own.dir) / f"rankmem-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {own.dir}: {exc}")
    try:
        try:
            (path / limit_name).write_text(str(limit_bytes))
        except OSError as exc:
            pytest.skip(f"cannot set {limit_name} of a scratch cgroup: {exc}")
        yield path
    finally:
        _empty_and_remove(path, Path(own.dir))


def move_into(cgroup: Path, pid: int) -> None:
    (cgroup / "cgroup.procs").write_text(str(pid))


def run_in_cgroup(cgroup: Path, script: str, args: list[str], env: dict[str, str],
                  timeout: float = 60) -> tuple[int, int, str, str]:
    """Run the Python ``script`` with ``args`` inside ``cgroup`` from its first allocation on: the child
    blocks on a pipe until it has been moved in. Returns its pid, exit status, stdout and stderr."""
    r, w = os.pipe()
    gate = f"import os; os.read({r}, 1); exec(open(0).read())"
    child = subprocess.Popen([sys.executable, "-c", gate, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, pass_fds=(r,))
    try:
        move_into(cgroup, child.pid)
        os.write(w, b"x")
        out, err = child.communicate(script, timeout=timeout)
    finally:
        os.close(r)
        os.close(w)
        if child.poll() is None:
            child.kill()
            child.wait(10)
    return child.pid, child.returncode, out, err


def _empty_and_remove(path: Path, parent: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(str(pid))  # out first: a cgroup with tasks cannot go
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # every process in it is the test's own
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # a just-killed task leaves the cgroup when it is reaped


def popen_in_cgroup(cgroup: Path, cmd: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``cmd`` inside ``cgroup`` from its first allocation on: a shell moves itself in, then execs
    it, so every process ``cmd`` forks is born inside. Its own session (``os.killpg`` stops the lot)."""
    enter = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
    return subprocess.Popen([*enter, *cmd], start_new_session=True, text=True, **kwargs)


def oom_kills(cgroup: Path) -> int:
    """The kernel OOM killer's kills in ``cgroup``: v1 ``memory.oom_control`` (Linux >= 4.13), v2
    ``memory.events``."""
    name = "memory.oom_control" if (cgroup / "memory.oom_control").exists() else "memory.events"
    return _procfs.parse_keyed((cgroup / name).read_bytes())["oom_kill"]


def anon_bytes(cgroup: Path) -> int:
    """Anonymous memory charged to ``cgroup`` (v1 ``rss`` of memory.stat, v2 ``anon``): what the OOM
    killer cannot reclaim, unlike the page cache also counted in its usage."""
    stat = _procfs.parse_keyed((cgroup / "memory.stat").read_bytes())
    return stat["rss"] if "rss" in stat else stat["anon"]


def kernel_bytes(cgroup: Path) -> int:
    """Kernel memory charged to ``cgroup`` (page tables, slab, stacks, sockets), which counts against its
    limit too: v1 ``memory.kmem.usage_in_bytes``, v2 ``kernel`` of memory.stat (Linux >= 5.18) or its parts."""
    kmem = cgroup / "memory.kmem.usage_in_bytes"
    if kmem.exists():
        return int(kmem.read_text())
    stat = _procfs.parse_keyed((cgroup / "memory.stat").read_bytes())
    if "kernel" in stat:
        return stat["kernel"]
    return sum(stat.get(k, 0) for k in ("kernel_stack", "pagetables", "percpu", "sock", "slab"))
