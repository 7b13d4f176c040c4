"""Shared by the benches that measure a collective: launch a script's ``--worker`` under torchrun, and
the clock they time the training thread's telemetry with."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_result(script: str, world: int) -> dict[str, Any]:
    """Run ``script --worker`` on ``world`` local ranks (gloo, one thread each); its last JSON line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", script, "--worker"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    result: dict[str, Any] = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return result


def run_worker(script: str, world: int, argv: list[str], timeout: float = 900) -> int:
    """``script --worker argv`` on ``world`` local ranks (gloo, one thread each), its output shown; its exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
           "--max-restarts", "0", script, "--worker", *argv]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout).returncode


class Clock:
    """Adds up the wall time and this thread's CPU time spent inside ``with`` blocks."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.thread_time() - self._cpu
