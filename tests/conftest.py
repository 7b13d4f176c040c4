"""Shared test helpers: real multi-process gloo groups and real torchrun launches, each with a timeout."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PROCESS_TIMEOUT_S = 240  # no subprocess in the suite may outlive this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    extra: Sequence[str] = (),
    timeout: float = PROCESS_TIMEOUT_S,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Launch ``script`` under a real torchrun on loopback; returns the completed process.

    ``free_port()`` can race with another process on the machine for the rendezvous port: a launch that
    fails with "Address already in use" is retried once on a new port.
    """
    proc = _torchrun_once(script, nproc, args, extra=extra, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0 and "Address already in use" in proc.stderr:
        proc = _torchrun_once(script, nproc, args, extra=extra, timeout=timeout, env=env, cwd=cwd)
    return proc


def _torchrun_once(
    script: str | Path,
    nproc: int,
    args: Sequence[str],
    *,
    extra: Sequence[str],
    timeout: float,
    env: dict[str, str] | None,
    cwd: str | Path | None,
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        *extra, str(script), *args,
    ]
    mark = uuid.uuid4().hex
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), LAUNCH_MARK: mark}
    # A script under tests/dist_scripts may import the tests' own helpers (``tests.*``): torchrun puts
    # only the script's folder on sys.path, so the repository goes first on PYTHONPATH.
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)
    finally:
        _stop_marked(mark)


LAUNCH_MARK = "RANKMEM_TEST_LAUNCH"
"""In the environment of every process a test's torchrun launch starts: a timeout kills torchrun's agent
alone, and its ranks, orphaned, would go on running (a restarted attempt's gloo mesh then dialled them)."""


def _stop_marked(mark: str) -> None:
    """SIGKILL every process still alive that carries ``mark`` (the launch is over: none should)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get(LAUNCH_MARK) == mark:
                p.kill()
        except psutil.Error:
            continue


@pytest.fixture
def run_torchrun():  # type: ignore[no-untyped-def]
    return torchrun


def sigint_as_at_a_terminal() -> None:
    """``preexec_fn`` for a child the test ends with SIGINT, as Ctrl-C would: a suite run as a background
    job (``cmd &`` in a script) inherits SIGINT ignored, and so would the child, which then never ends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)



def run_at_a_terminal(argv: Sequence[str], *, cwd: Path, env: dict[str, str], done: Callable[[str], bool],
                      timeout: float = 60) -> tuple[int, str]:
    """Run ``argv`` at a terminal (a pty, 150x40) until ``done(what it printed so far)`` holds, it exits, or
    ``timeout`` passes; then SIGINT, as Ctrl-C would. Returns its exit status and everything it printed,
    what it drew on the way out included. ``done`` may act on the text (write to the run it watches)."""
    master, slave = pty.openpty()
    env = {**env, "TERM": "xterm", "COLUMNS": "150", "LINES": "40"}
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=sigint_as_at_a_terminal)
    os.close(slave)
    chunks: list[bytes] = []

    def read(wait: float) -> bool:
        ready, _, _ = select.select([master], [], [], wait)
        try:
            data = os.read(master, 65536) if ready else b""
        except OSError:  # EIO: the terminal's other end closed
            return False
        chunks.append(data)
        return bool(data)

    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            read(0.5)
            if done(b"".join(chunks).decode("utf-8", "replace")):
                break
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        while read(0.2):  # what it printed on the way out
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")

def start_ray(ray: Any, **options: Any) -> None:
    """A local Ray cluster for an in-process test, through rankmem's own start (which stops what a failed
    start leaves). Ray gives its raylet a fixed 30 s to register; on a machine loaded by the rest of the
    suite that can pass, so a failed start is tried once more before the test fails."""
    from rankmem.ray.cluster import start_local

    try:
        start_local(ray, **options)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when its node times out
        print(f"the local Ray cluster did not start ({exc}); trying once more")
        start_local(ray, **options)


@pytest.fixture
def only_new_children() -> Iterator[list[int]]:
    """For a test of the children figures in the suite's own process: a descendant it already has (a
    process another test left behind) is waited for (10 s), else the test is skipped naming it, so that
    only what the test starts is counted."""
    import psutil

    deadline = time.monotonic() + 10
    strays = [p.pid for p in psutil.Process().children(recursive=True)]
    while strays and time.monotonic() < deadline:
        time.sleep(0.2)
        strays = [p.pid for p in psutil.Process().children(recursive=True)]
    if strays:
        pytest.skip(f"descendants this test did not start are still running: {strays}")
    yield strays


TRAIN_STEPS = 20
"""``rankmem train`` in README's and docs/'s commands runs at most this many steps (``make demo``'s 400 take
minutes)."""


def train_steps_cap(words: Sequence[str]) -> list[str]:
    """What to append to a ``rankmem train`` command (``words``) so it runs at most :data:`TRAIN_STEPS`
    steps (argparse keeps the last ``--steps``); nothing for any other command."""
    if list(words[:2]) != ["rankmem", "train"]:
        return []
    steps = words[words.index("--steps") + 1] if "--steps" in words else None
    return ["--steps", str(TRAIN_STEPS)] if steps is None or int(steps) > TRAIN_STEPS else []


def command_env() -> dict[str, str]:
    """A README command's environment: one thread, and a free rendezvous port for torchrun."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())}


DEMO_COMMAND = f"rankmem train --nproc-per-node 2 --out runs/demo --steps {TRAIN_STEPS}"
"""How :func:`make_demo_workdir` makes ``runs/demo``; its output is kept in ``train.out`` there."""


def make_demo_workdir(work: Path) -> Path:
    """``work`` as after ``make demo`` in a fresh clone: ``examples/`` and a short ``runs/demo``."""
    (work / "examples").symlink_to(REPO / "examples")
    done = subprocess.run([sys.executable, "-m", *DEMO_COMMAND.split()], cwd=work, env=command_env(),
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (work / "train.out").write_text(done.stdout)
    return work


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo directory for the README's commands and the docs' samples (one launch, not two)."""
    return make_demo_workdir(tmp_path_factory.mktemp("readme"))


@pytest.fixture(scope="session")
def once_in_demo(demo_workdir: Path) -> Callable[[Sequence[str]], subprocess.CompletedProcess[str]]:
    """Runs a command that makes a run (README's ``rankmem train ... --out runs/advise``) in the demo
    directory the first time a test asks, and gives every later asker that launch's result: README's
    commands, the samples and docs/advice.md show the same command (one launch, not three)."""
    done: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        if tuple(argv) not in done:
            done[tuple(argv)] = subprocess.run(list(argv), cwd=demo_workdir, env=command_env(), capture_output=True,
                                               text=True, timeout=PROCESS_TIMEOUT_S)
        return done[tuple(argv)]

    return run
