"""Sink faults (issue 11, item 6): an outage is retried with backoff and its span reported when it ends,
the run log survives a disk that fills and empties again (a real tmpfs where the test may mount one),
and a key a tracker refuses costs that key, never the sink."""

from __future__ import annotations

import errno
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import rankmem
from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.offline import read_run
from rankmem.sinks import SafeSink, make_sink

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFor:
    """A sink whose disk is full for steps ``first..last``: every write there raises ENOSPC."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.written: list[int] = []
        self.tries: list[int] = []

    def open(self, header: object) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.tries.append(record.step)
        if self.first <= record.step <= self.last:
            raise ENOSPC
        self.written.append(record.step)

    def close(self) -> None:
        pass


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("rankmem: sink")]


def test_a_sink_down_for_a_span_of_steps_comes_back_and_reports_the_span() -> None:
    sink = _FullFor(21, 99)  # the disk fills at step 21 and has room again from step 100
    monitor = rankmem.Monitor(sinks=(sink,), device="cpu", children=False, leak_check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(300):
            monitor.collect({"loss": 1.0}, step=step)
        assert monitor.flush(60)
        monitor.close()
    # Tries after 1, 2, 4, ... 64 skipped steps: 21 (fails), 23, 26, 31, 40, 57, 90, then 155 succeeds.
    assert sink.tries[21:29] == [21, 23, 26, 31, 40, 57, 90, 155]
    assert sink.written == [*range(21), *range(155, 300)]
    assert _messages(caught) == [
        "rankmem: sink _FullFor failed in write() at step 21: OSError(28, 'No space left on device'); retrying it "
        "with backoff (the steps lost are reported when it recovers)",
        "rankmem: sink _FullFor is writing again from step 155; 134 logged step(s) lost (steps 21..154) over 7 "
        "failed tries, the last in write() with OSError(28, 'No space left on device')",
    ]


def test_a_sink_that_could_not_open_is_opened_at_its_next_try() -> None:
    class DownAtStart(_FullFor):
        opens = 0

        def open(self, header: object) -> None:
            self.opens += 1
            if self.opens == 1:
                raise ConnectionError("tracker server unreachable")

    sink = DownAtStart(-1, -1)
    safe = SafeSink(sink)
    header = RunHeader(world_size=1, ranks=[], config={}, started=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe.open(header)
        for step in range(4):
            safe.write(StepRecord(step, 0.0, {"a/max": 1.0}, {}))
        safe.close()
    assert sink.opens == 2 and sink.written == [1, 2, 3]  # step 0 skipped (backoff 1), then opened and written
    assert _messages(caught)[-1] == ("rankmem: sink DownAtStart is writing again from step 1; 1 logged step(s) lost "
                                     "(step 0) over 1 failed try, the last in open() with "
                                     "ConnectionError('tracker server unreachable')")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, mounted for the test (root only; skipped elsewhere)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


def test_the_run_log_survives_a_disk_that_fills_and_empties(small_tmpfs: Path) -> None:
    out = small_tmpfs / "run"
    monitor = rankmem.Monitor(out_dir=str(out), device="cpu", children=False, leak_check=False)
    # Wide lines (~10 KiB): a write into the log's last, partly free page is cut short by the full disk.
    metrics = {f"k{i:03d}": float(i) for i in range(100)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(300):
            if step == 20:
                assert monitor.flush(60)
                filler = _fill(small_tmpfs)
            if step == 100:
                assert monitor.flush(60)
                filler.unlink()  # space returns
            monitor.collect(metrics, step=step)
        assert monitor.flush(60)
        monitor.close()
    run = read_run(str(out))
    assert run.corrupt == 0 and not run.truncated  # no torn line was left behind by a failed write
    steps = run.steps.tolist()
    first_lost = next(i for i, s in enumerate(steps) if s != i)
    assert 20 <= first_lost <= 22  # the log's last page may take a line or two before the disk refuses
    # The run log tries every collect itself: it writes again at the first one after space returns, and
    # names the steps in between in a gap record.
    assert steps == [*range(first_lost), *range(100, 300)] and run.logged is None
    assert run.series["k099"][:, 0].tolist() == [99.0] * len(steps)
    assert [(g.first, g.last, g.count) for g in run.gaps] == [(first_lost, 99, 100 - first_lost)]
    assert run.gaps[0].why == "the disk refused it (No space left on device)"
    messages = [str(w.message) for w in caught if "run log" in str(w.message) or "sink" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(f"rankmem: the run log {out / 'rankmem.jsonl'} could not "
                                                         f"take step {first_lost} (the disk refused it")


def test_a_key_mlflow_refuses_is_renamed_and_the_sink_stays_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    long_key = "mem/phase/" + "x" * 300 + "/peak_rss_gib/max"  # MLflow allows 250 characters
    sink = make_sink("mlflow", str(tmp_path))
    safe = SafeSink(sink)
    ranks = [RankInfo(rank=0, local_rank=0, host="node0", pid=1, device="none", peak_rss_scope="window")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe.open(RunHeader(world_size=1, ranks=ranks, config={}, started=1.7e9))
        for step in range(3):
            safe.write(StepRecord(step, 1.7e9 + step, {"loss/max": float(step), long_key: 1.0, "/a//b/./c/": 2.0}, {}))
        safe.close()
    assert _messages(caught) == [] and safe.lost == 0
    client = MlflowClient(tracking_uri=sink.tracking_uri)
    metrics = client.get_run(sink.run_id).data.metrics
    assert [m.value for m in client.get_metric_history(sink.run_id, "loss/max")] == [0.0, 1.0, 2.0]
    (renamed,) = [k for k in metrics if k.startswith("mem/phase/xxx")]
    assert len(renamed) == 250 and metrics["a/b/c"] == 2.0


def test_a_second_monitor_on_a_run_directory_in_use_writes_nothing(tmp_path: Path) -> None:
    import socket

    first = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, leak_check=False)
    first.collect({"loss": 0.0}, step=0)
    assert first.flush(30)
    second = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, leak_check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.collect({"loss": 9.0}, step=0)
        second.close()
    assert _messages(caught) == [
        f"rankmem: sink JsonlSink failed in open() and is disabled: {tmp_path} is in use by another rankmem job "
        f"(pid {os.getpid()} on {socket.gethostname()} holds {tmp_path}/.lock): two jobs writing one run directory "
        "overwrite each other's log; wait for it to end or choose another run directory"
    ]
    first.collect({"loss": 1.0}, step=1)
    first.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == [0, 1] and run.series["loss"][:, 0].tolist() == [0.0, 1.0]
    assert not (tmp_path / "rankmem.jsonl.1").exists()  # the refused writer moved nothing aside
    third = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, leak_check=False)
    with pytest.warns(RuntimeWarning, match="from an earlier run"):  # the first closed: the directory is free again
        third.collect({"loss": 2.0}, step=0)
        third.close()
