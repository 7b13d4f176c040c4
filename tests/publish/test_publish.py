"""The background publisher: records reach the sinks without waking the thread per collect, a filling
queue wakes it, a stalled sink never blocks the caller (drop-oldest, counted, one warning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rankmem
from rankmem.core.guard import Guard
from rankmem.core.records import RunHeader, StepRecord
from rankmem.exchange.aggregate import Gathered
from rankmem.offline import read_run
from rankmem.publish.publisher import Publisher
from tests.conftest import REPO


class Recorder:
    """A sink that records the steps it was given; ``gate`` (when set) holds every write until opened."""

    def __init__(self, expect: int, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.gate = gate
        self.expect = expect
        self.done = threading.Event()
        self.entered = threading.Event()

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        self.steps.append(record.step)
        if len(self.steps) >= self.expect:
            self.done.set()

    def close(self) -> None:
        pass


def _gathered(value: float) -> Gathered:
    return Gathered(["loss"], np.array([[value]]), {"loss/max": value}, mixed=False)


def _header() -> RunHeader:
    return RunHeader(world_size=1, ranks=[], config={}, started=0.0)


def test_a_record_reaches_the_sink_without_a_flush() -> None:
    sink = Recorder(expect=1)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.POLL_S = 0.05
    publisher.open(_header())
    publisher.publish(7, 0.0, _gathered(1.0))
    assert sink.done.wait(30)  # the thread found it on its own: nothing woke it
    assert sink.steps == [7]
    publisher.close()


def test_a_half_full_queue_wakes_the_thread() -> None:
    n = Publisher.MAX_PENDING // 2 + 1  # the header counts as one pending item
    sink = Recorder(expect=n)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.POLL_S = 3600.0  # without the wake, nothing would be written within the test's life
    publisher.open(_header())
    for step in range(n):
        publisher.publish(step, 0.0, _gathered(float(step)))
    assert sink.done.wait(30)
    assert sink.steps[:n] == list(range(n))
    publisher.close()


def test_a_stalled_sink_drops_the_oldest_records_and_warns_once() -> None:
    gate = threading.Event()
    sink = Recorder(expect=1, gate=gate)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.open(_header())
    publisher.publish(0, 0.0, _gathered(0.0))
    assert sink.entered.wait(30)  # the thread is stuck in the sink with step 0
    assert publisher.flush(0.1) is False
    extra = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, Publisher.MAX_PENDING + extra + 1):
            publisher.publish(step, 0.0, _gathered(float(step)))  # never blocks
    assert publisher.dropped == extra
    assert [str(w.message) for w in caught] == [
        "rankmem: the sinks fall behind the training loop; the oldest pending records are dropped "
        "(Publisher.dropped counts them) rather than blocking training"]
    gate.set()
    assert publisher.flush(30)
    last = Publisher.MAX_PENDING + extra
    assert sink.steps == [0, *range(extra + 1, last + 1)]
    publisher.close()


@pytest.mark.parametrize("background", [True, False])
def test_close_writes_what_is_pending(background: bool) -> None:
    sink = Recorder(expect=3)
    publisher = Publisher([sink], leak_check=False, guard=Guard(), background=background)
    publisher.POLL_S = 3600.0
    publisher.open(_header())
    for step in range(3):
        publisher.publish(step, 0.0, _gathered(float(step)))
    publisher.close()
    assert sink.steps == [0, 1, 2]


def _monitor(out: Path, **options: Any) -> rankmem.Monitor:
    return rankmem.Monitor(out_dir=str(out), device="cpu", near_oom_watch=False, **options)


# ---- Publisher: a second close() (or a flush after close) waits the whole flush timeout ----------

def test_second_close_returns_at_once(tmp_path: Path) -> None:
    """Monitor.close() says "safe to call twice" (and `with Monitor(...) as m: ...; m.close()` does it),
    but the second Publisher.flush() waited on a thread that had already exited: the whole flush timeout
    of blocking, then a false "the sinks did not finish" warning."""
    m = _monitor(tmp_path)
    m.collect({"loss": 1.0})
    m.close()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.close()
    took = time.monotonic() - t0
    assert took < 1.0, f"the second close() blocked {took:.1f} s"
    assert not [str(w.message) for w in caught if "did not finish" in str(w.message)]


# ---- sink_thread=False: exit without close() loses every per-rank value of the run --------------

_EXIT_WITHOUT_CLOSE = """
import sys, rankmem
m = rankmem.Monitor(out_dir=sys.argv[1], device="cpu", near_oom_watch=False, sink_thread=False)
for i in range(5):
    with m.step(i):
        pass
    m.collect({"loss": float(i)})
# the script ends without m.close(): _publish's atexit flush should still write the last batch
"""


def test_exit_without_close_keeps_per_rank_values_with_sink_thread_off(tmp_path: Path) -> None:
    """_flush_at_exit -> flush_all() only sees publishers in _live, which a publisher joins when its
    background thread starts; with sink_thread=False it never does, so the run log's pending per-rank
    batch (DetailWriter, up to FLUSH_S of collects) is never written: read_run finds no per-rank values.
    WorkerGroup.shutdown's flush_telemetry misses it the same way."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    run = read_run(str(tmp_path))
    assert run.logged is None or list(run.logged.steps) == [0, 1, 2, 3, 4]
    assert list(run.steps) == [0, 1, 2, 3, 4], "per-rank values of the logged steps are missing"
    assert run.series["loss"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


# ---- A forked child exiting normally waits for the parent's publisher thread ---------------------

_FORK_EXIT = """
import os, sys, time
import torch  # what a training process has loaded: its own exit in a forked child takes a while
if sys.argv[1] != "-":
    import rankmem
    m = rankmem.Monitor(out_dir=sys.argv[1], device="cpu", near_oom_watch=False)
    m.collect({"loss": 1.0})
    assert m.flush(10)
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child ends the ordinary way: atexit handlers run
os.waitpid(pid, 0)
print(f"{time.monotonic() - t0:.3f}")
if sys.argv[1] != "-":
    m.close()
"""


def _fork_exit_seconds(out: str) -> float:
    proc = subprocess.run([sys.executable, "-c", _FORK_EXIT, out], capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


def test_forked_child_exit_does_not_wait_for_the_parents_publisher(tmp_path: Path) -> None:
    """The child inherits _live (and the Publisher whose thread exists only in the parent); its atexit
    flush_all() would wait the handoff's FLUSH_TIMEOUT_S (5 s) per publisher for a thread that is not
    there (and block for ever if the fork caught the publisher thread holding its Condition's lock).
    The yardstick is the same fork without a monitor: torch's own exit in the child takes 0.1 s on an
    idle machine and over 2 s on a loaded one."""
    bare = _fork_exit_seconds("-")
    took = _fork_exit_seconds(str(tmp_path))
    assert took < bare + 10.0, f"the forked child took {took:.1f} s to exit, {bare:.1f} s without a monitor"


# ---- The dict collect() returns is the one the background thread writes later ------------------

def test_caller_editing_the_collect_result_does_not_change_the_run_log(tmp_path: Path) -> None:
    """collect() returns gathered.aggregated and hands the same dict to the publisher, whose thread
    encodes it up to POLL_S later: a caller that edits its result (metrics.update(...), pop, a
    rename, as verl-style loops do) rewrites the run log's aggregates."""
    m = _monitor(tmp_path)
    out = m.collect({"loss": 1.0}, step=0)
    out["loss/max"] = 999.0
    out.pop("mem/host/rss_gib/max", None)
    m.close()
    lines = (tmp_path / "rankmem.jsonl").read_text().splitlines()
    logged = json.loads(lines[1])["metrics"]
    assert logged["loss/max"] == 1.0
    assert "mem/host/rss_gib/max" in logged
    run = read_run(str(tmp_path), metrics=True)
    assert run.metrics is not None and run.metrics["loss/max"].tolist() == [1.0]


# ---- sink_thread=False: a flush from another thread runs inside a sink's write ------------------

class _OverlapSink:
    def __init__(self) -> None:
        self.in_write = threading.Event()
        self.release = threading.Event()
        self.flush_during_write = False

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.in_write.set()
        assert self.release.wait(10)
        self.in_write.clear()

    def flush(self) -> None:
        if self.in_write.is_set():
            self.flush_during_write = True

    def close(self) -> None:
        pass


def test_sync_publisher_flush_from_another_thread_waits_for_the_write() -> None:
    """Monitor(sink_thread=False) writes on the training thread, but Publisher.flush() with no thread
    calls _handle(_FLUSH) on the caller's thread: the near-OOM watch's flush (Forensics' flush=) then
    runs RunLogWriter.flush -> DetailWriter.flush concurrently with DetailWriter.add on the training
    thread (unlocked lists and the stream writer's buffer: collects lost or a batch written twice)."""
    sink = _OverlapSink()
    publisher = Publisher([sink], leak_check=False, guard=Guard(), background=False)
    publisher.open(RunHeader(world_size=1, ranks=[], config={}, started=0.0))
    gathered = Gathered(["loss"], np.array([[1.0]]), {"loss/max": 1.0}, mixed=False)
    writer = threading.Thread(target=publisher.publish, args=(0, 0.0, gathered))
    writer.start()
    assert sink.in_write.wait(10)
    flusher = threading.Thread(target=publisher.flush, args=(2.0,))  # what the near-OOM watch does
    flusher.start()
    flusher.join(0.5)
    sink.release.set()
    writer.join(10)
    flusher.join(10)
    assert not sink.flush_during_write, "the sink's flush() ran inside its write(), on another thread"


# ---- A flush racing close() (flush_all from a Ray actor's control thread while the job closes) ----------

class _SlowCloseSink:
    def __init__(self) -> None:
        self.written: list[int] = []

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        time.sleep(0.2)
        self.written.append(record.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        time.sleep(0.5)


def test_a_flush_racing_close_returns_when_close_is_done() -> None:
    sink = _SlowCloseSink()
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.open(RunHeader(world_size=1, ranks=[], config={}, started=0.0))
    for step in range(3):
        publisher.publish(step, 0.0, Gathered(["loss"], np.array([[1.0]]), {"loss/max": 1.0}, mixed=False))
    closer = threading.Thread(target=publisher.close)
    closer.start()
    time.sleep(0.85)  # close() has flushed the records (0.6 s) and stopped the thread; it closes the sink
    started = time.monotonic()
    assert publisher.flush(10.0)
    took = time.monotonic() - started
    closer.join(10)
    assert sink.written == [0, 1, 2]
    # Nothing left to wait for: not its 10 s timeout for a thread that has ended.
    assert took < 3.0, took
