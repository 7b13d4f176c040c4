"""The report's "what held the peak" lines from anatomy events as ranks write them and the reader parses
them back: the heaviest rank against the median rank, an OOM's replay named, damaged fields dropped."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import rankmem
from rankmem.core.events import Event
from rankmem.core.units import MIB
from rankmem.engine.model import GPT, GPTConfig
from rankmem.forensics.events import EventWriter
from rankmem.forensics.replay import replay
from rankmem.forensics.sampler import ModuleTags
from rankmem.offline.events import read_events
from rankmem.offline.holders import holder_lines
from rankmem.testing import FakeCuda
from tests.anatomy_recorder import Recorder


def _replayed(tokens: int) -> dict[str, object]:
    """One rank's update window (forward and backward of ``tokens`` tokens), replayed."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=256, n_layer=2, n_head=4, n_embd=64))
    idx = torch.randint(0, 1024, (1, tokens))
    rec = Recorder()
    rec.adopt(*model.parameters(), idx)
    tags = ModuleTags(rec.set_metadata, lambda: "update")
    tags.name(model)
    with rec:
        tags.install()
        baseline = rec.segments()
        model(idx).logsumexp(-1).sum().backward()
        tags.remove()
        snap = rec.snapshot()
    return replay(snap, baseline)


def test_the_rank_with_twice_the_tokens_is_named_by_its_activation_excess(tmp_path: Path) -> None:
    found = {rank: _replayed(256 if rank == 2 else 128) for rank in range(4)}
    for rank, window in found.items():
        event = Event(kind="anatomy", rank=rank, step=10, extra={"source": "sample", **window})
        EventWriter(str(tmp_path), rank).write(event)
    events = read_events(str(tmp_path)).events
    acts = {r: w["categories"]["activations"] for r, w in found.items()}  # type: ignore[index]
    over = (acts[2] - statistics.median(acts.values())) / 2**20
    top = [h for h in found[2]["top"] if h[0] == "activations"][:2]  # type: ignore[union-attr]
    (line,) = holder_lines(events)
    assert line.startswith(f"rank 2: activations +{over:.1f} MiB over the median rank (peak ")
    assert line.endswith(", top: " + ", ".join(f"{h[1]} {h[2] / 2**20:.1f} MiB" for h in top))
    assert top[0][1] == "head"  # the logits: vocab x tokens x 4 B, the largest single activation


def test_an_oom_replay_is_named_and_a_damaged_event_is_dropped() -> None:
    oom = Event(kind="anatomy", rank=3, step=7, phase="update", extra={
        "source": "oom", "instant": "oom", "peak_bytes": 3 << 30,
        "categories": {"activations": 2 << 30, "parameters": 1 << 30, "temporaries": 0},
        "top": [["activations", "lm_head", 1 << 30, 1], ["parameters", "parameters", 1 << 30, 9]]})
    damaged = Event(kind="anatomy", rank=1, step=7,
                    extra={"peak_bytes": "a lot", "categories": {}, "top": []})
    assert holder_lines([oom, damaged]) == [
        "rank 3 OOM at step 7 (update): activations 2.0 GiB, parameters 1.0 GiB; "
        "top: lm_head (activations) 1.0 GiB, parameters (parameters) 1.0 GiB"]


def test_rankmem_report_shows_a_sampled_window_and_keeps_it_out_of_the_events(tmp_path: Path) -> None:
    cuda = FakeCuda()
    cuda.init()
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device_module=cuda, children=False, near_oom_watch=False,
                              nvml_refresh_s=None, anatomy_every=2)
    for step in range(2):
        with monitor.step(step):
            cuda.free(cuda.malloc(64 * MIB))
        monitor.collect()
    monitor.close()
    done = subprocess.run([sys.executable, "-m", "rankmem", "report", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["events"] == []  # a replay is no failure
    assert report["holders"] == ["rank 0 step 1: peak 64.0 MiB = temporaries 64.0 MiB, top: "
                                 f"test_rankmem_report_shows_a_sampled_window_and_keeps_it_out_of_the_events"
                                 f"@test_holders.py:{_line('cuda.free(cuda.malloc(64 * MIB))')} 64.0 MiB"]


def _line(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)
