"""Tracker sinks, read back with each tracker's own reader; SafeSink; missing extras."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import rankmem
from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.errors import MissingExtraError
from rankmem.sinks import SafeSink, make_sink

RSS_MAX = "mem/host/rss_gib/max"
ODD = "loss(avg)/max"  # characters MLflow and TensorFlow reject


def _header() -> RunHeader:
    ranks = [RankInfo(rank=r, local_rank=r, host="node0", pid=1, device="none",
                      peak_rss_scope="window") for r in range(2)]
    return RunHeader(world_size=2, ranks=ranks, config={}, started=1.7e9)


def _records() -> list[StepRecord]:
    return [
        StepRecord(step=s, time=1.7e9 + s, metrics={RSS_MAX: 1.0 + s / 4, ODD: 0.5 * s, "dead/max": float("nan")},
                   ranks={})
        for s in (0, 5, 10)
    ]


def _drive(sink: Any) -> None:
    sink.open(_header())
    for r in _records():
        sink.write(r)
    sink.close()


def test_tensorboard_sink_reads_back_with_event_accumulator(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _drive(make_sink("tensorboard", str(tmp_path)))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss_avg_/max", RSS_MAX]  # nan left out, odd chars replaced
    assert [(e.step, e.value) for e in acc.Scalars(RSS_MAX)] == [(0, 1.0), (5, 2.25), (10, 3.5)]
    assert [e.value for e in acc.Scalars("loss_avg_/max")] == [0.0, 2.5, 5.0]


def test_mlflow_sink_local_store_reads_back_with_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the sink sets it
    sink = make_sink("mlflow", str(tmp_path))
    _drive(sink)
    assert sink.tracking_uri.startswith(("file://", "sqlite:///")) and str(tmp_path) in sink.tracking_uri
    client = MlflowClient(tracking_uri=sink.tracking_uri)
    history = client.get_metric_history(sink.run_id, RSS_MAX)
    assert [(m.step, m.value, m.timestamp) for m in history] == [
        (0, 1.0, 1.7e12), (5, 2.25, 1.7e12 + 5000), (10, 3.5, 1.7e12 + 10000)]
    assert [m.value for m in client.get_metric_history(sink.run_id, "loss_avg_/max")] == [0.0, 2.5, 5.0]
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rankmem.world_size"] == "2"
    assert "dead/max" not in run.data.metrics


def _wandb_records(path: Path) -> list[Any]:
    """Records of a run's ``.wandb`` transaction log: W&B's LevelDB-style framing (a 7-byte file header,
    32 KiB blocks, each chunk ``crc32:u32 length:u16 type:u8``), protobuf ``Record`` payloads."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, out, partial = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(partial)
            out.append(record)
    return out


@pytest.mark.timeout(120)
def test_wandb_sink_offline_run_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = make_sink("wandb", str(tmp_path))
    _drive(sink)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # wandb-core (0.19+) writes files/wandb-summary.json only when online (wandb/wandb#9646), so read the
    # history from the run's own transaction log, which `wandb sync` uploads.
    (log,) = run_dir.glob("run-*.wandb")
    # finish() can return before W&B's service process has written the last records: wait (bounded)
    # for the run's closing "exit" record.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(log)):
            break
        time.sleep(0.2)
    history = [
        {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
        for r in _wandb_records(log)
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h[RSS_MAX], h[ODD]) for h in history] == [(0, 1.0, 0.0), (5, 2.25, 2.5), (10, 3.5, 5.0)]
    assert all("dead/max" not in h for h in history)
    summary_file = run_dir / "files" / "wandb-summary.json"
    if summary_file.exists():  # newer wandb writes it offline too
        assert json.loads(summary_file.read_text())[RSS_MAX] == 3.5


class _Boom:
    def __init__(self) -> None:
        self.writes = 0
        self.closes = 0

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.writes += 1
        raise OSError("disk full")

    def close(self) -> None:
        self.closes += 1  # a disabled sink still holds its files: it is closed all the same


def test_a_sink_that_keeps_failing_is_retried_with_backoff_and_closed() -> None:
    boom = _Boom()
    safe = SafeSink(boom)
    safe.open(_header())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in _records():  # steps 0 (fails), 5 (skipped: backoff 1), 10 (tried again, fails)
            safe.write(r)
        safe.close()
    assert boom.writes == 2 and safe.lost == 3 and boom.closes == 1
    assert [str(w.message) for w in caught] == [
        "rankmem: sink _Boom failed in write() at step 0: OSError('disk full'); retrying it with backoff "
        "(the steps lost are reported when it recovers)",
        "rankmem: sink _Boom was still failing when closed; 3 logged step(s) lost (steps 0..10) over 2 failed "
        "tries, the last in write() with OSError('disk full')",
    ]


def test_missing_tracker_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(MissingExtraError,
                       match=r"the wandb sink needs wandb, which is not installed: pip install 'rankmem\[wandb\]'"):
        make_sink("wandb", "/tmp")


def test_monitor_writes_tensorboard_and_run_log(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = rankmem.Monitor(out_dir=str(tmp_path), sinks=("jsonl", "tensorboard"), device="cpu", children=False)
    for step in range(3):
        with monitor.step(step):
            pass
        monitor.collect({"loss": float(step)})
    monitor.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/max")] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert (tmp_path / "rankmem.jsonl").read_text().count("\n") == 4



def test_a_tracker_whose_install_is_broken_costs_its_sink_not_the_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker is imported when its sink opens; a broken install raises anything there (here a RuntimeError,
    as a package built for another numpy does). SafeSink, a boundary of rankmem.core.guard, takes it:
    training and the run log go on, with one warning while it runs and the outage's account at close."""

    class Broken(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("tensorboard was built for another protobuf")

    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", Broken("event_file_writer"))
    with pytest.warns(RuntimeWarning) as caught:
        monitor = rankmem.Monitor(out_dir=str(tmp_path), sinks=("jsonl", "tensorboard"), device="cpu", children=False)
        for step in range(5):
            with monitor.step(step):
                pass
            assert monitor.collect({"loss": float(step)})["loss/max"] == step
        assert monitor.flush(30)
        during = [str(w.message) for w in caught]
        monitor.close()
    assert during == ["rankmem: sink TensorBoardSink failed in open(): RuntimeError('tensorboard was built for "
                      "another protobuf'); retrying it with backoff (the steps lost are reported when it recovers)"]
    assert len(caught) == 2 and "TensorBoardSink was still failing when closed" in str(caught[1].message)
    assert (tmp_path / "rankmem.jsonl").read_text().count("\n") == 6  # the header and every step


def test_mlflow_sink_makes_a_key_starting_with_two_dots_valid(tmp_path: Path) -> None:
    """mlflow_key keeps "..x/max" (its normpath is itself) but MLflow refuses any name whose normpath
    starts with "..": the whole log_batch is refused, so under SafeSink every key of every step is lost
    (the outage never ends) because of one caller metric named "..x"."""
    import time

    from rankmem.core.records import RankInfo, RunHeader, StepRecord
    from rankmem.sinks._mlflow import MlflowSink

    sink = MlflowSink(out_dir=str(tmp_path))
    sink.open(RunHeader(world_size=1, ranks=[RankInfo(rank=0, local_rank=0, host="h", pid=1, device="none",
                                                      peak_rss_scope="window")], config={}, started=time.time()))
    sink.write(StepRecord(step=1, time=time.time(), metrics={"..x/max": 1.0, "mem/host/rss_gib/max": 2.0}))
    history = sink._client.get_metric_history(sink.run_id, "mem/host/rss_gib/max")
    assert [m.value for m in history] == [2.0]
    sink.close()
