"""Peak anatomy (rankmem.anatomy, docs/anatomy.md) against ground truth the tests make.

The device is a FakeCuda fed by real CPU tensors (tests/anatomy_helpers.py): its peak is the live
tensor bytes' peak, and the mirror records the gradient and optimizer bytes alive at that instant. The
split is checked on 2 and 4 gloo ranks, for a plain loop and the reference worker (each with two
micro-batches of gradient accumulation), against PyTorch's MemTracker, and on the host alone.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

import rankmem
from rankmem.core.units import GIB, MIB
from tests.anatomy_helpers import Mirror, TensorCuda, grad_bytes, optimizer_bytes
from tests.conftest import REPO, torchrun

PARTS = ("params", "optimizer", "grads_low", "grads_high", "activations", "slack", "other")
CONTEXT = 300 * MIB  # FakeCuda's CUDA context: device memory outside the allocator


def split(values: dict[str, Any], phase: str) -> dict[str, float]:
    """One rank's anatomy of ``phase`` in bytes (absent parts left out)."""
    out = {p: values.get(f"mem/phase/{phase}/anatomy/{p}_gib") for p in PARTS}
    return {p: v * GIB for p, v in out.items() if v is not None}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["loop", "worker"])
def test_split_on_every_rank_against_the_truth(tmp_path: Path, mode: str, world: int) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/anatomy_worker.py", world, [mode, str(tmp_path)], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    heavy = world - 1
    for r, data in enumerate(ranks):
        assert data["heavy"] == (2 if r == heavy else 1)
        for record in data["steps"]:
            for phase, (peak, grads, optimizer) in record["truth"].items():
                s, mine = split(record["mine"], phase), record["mine"]
                assert abs(s["params"] - data["params"] * GIB) <= 0.01 * MIB
                assert abs(s["optimizer"] - optimizer) <= 0.01 * MIB
                assert s["grads_low"] <= grads <= s["grads_high"], (r, phase, s, grads)
                if phase == "log_prob":  # no backward in it: the gradients are known
                    assert s["grads_low"] == s["grads_high"] == grads
                assert mine[f"mem/phase/{phase}/peak_allocated_gib"] * GIB == peak
                total = s["params"] + s["optimizer"] + s["grads_high"] + s["activations"]
                assert total == pytest.approx(peak, rel=1e-12)
                reserved = mine[f"mem/phase/{phase}/peak_reserved_gib"] * GIB
                assert s["slack"] == pytest.approx(reserved - peak, rel=1e-12)
                assert s["other"] == pytest.approx(CONTEXT, rel=1e-12)
    # The rank with twice the tokens: the largest activations, and its excess is in them.
    for step in range(len(ranks[0]["steps"])):
        aggregates = ranks[0]["steps"][step]["aggregates"]
        for phase in ("update", "log_prob"):
            assert aggregates[f"mem/phase/{phase}/anatomy/activations_gib/max_rank"] == heavy
            peaks = [rk["steps"][step]["truth"][phase][0] for rk in ranks]
            acts = [split(rk["steps"][step]["mine"], phase)["activations"] for rk in ranks]
            excess = peaks[heavy] - statistics.median(peaks[:heavy])
            assert excess > 0 and (acts[heavy] - statistics.median(acts[:heavy])) / excess >= 0.9


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: Any, steps: int,
          each: Any = None, after: Any = None) -> None:
    torch.manual_seed(1)
    for step in range(steps):
        with monitor.step(step) if monitor is not None else _null():
            with monitor.phase("update") if monitor is not None else _null():
                for tokens in (96, 192):  # the second micro-batch is heavier, and its gradients exist
                    if monitor is not None:
                        monitor.micro_batch(tokens)
                    if each is not None:
                        each()
                    model(torch.randn(tokens, 256)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if after is not None:
                after(step)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    return model, torch.optim.AdamW(model.parameters())


def test_against_memtracker() -> None:
    """The same steps under PyTorch's MemTracker (its per-step resets inside one context): at the peak,
    its parameter, optimizer and gradient bytes within 1% of the split, activations + temporaries too."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer = _model()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _loop(model, optimizer, None, 3, each=tracker.reset_mod_stats)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]

    model, optimizer = _model()
    cuda = TensorCuda()
    monitor = rankmem.Monitor(device="cuda", device_module=cuda, children=False, near_oom_watch=False,
                              nvml_refresh_s=None)
    params = list(model.parameters())
    mirror = Mirror(cuda, params)
    mirror.adopt(params)
    monitor.track(model, optimizer)
    with mirror:
        _loop(model, optimizer, monitor, 3)
    ours = split(monitor.local_metrics(), "update")
    monitor.close()
    assert ours["params"] == pytest.approx(theirs["Parameter"], rel=0.01)
    assert ours["optimizer"] == pytest.approx(theirs["Optstate"], rel=0.01)
    assert ours["grads_low"] <= theirs["Gradient"] * 1.01 and theirs["Gradient"] <= ours["grads_high"] * 1.01
    assert ours["grads_low"] == ours["grads_high"]  # the peak is in the second micro-batch: grads all there
    assert ours["activations"] == pytest.approx(theirs["Activation"] + theirs["Temp"], rel=0.01)


def test_host_split_sums_to_the_rss_peak() -> None:
    """No device: the host's RSS peak, split; slack is the allocator's, absent here, never 0. Activations
    here are what the RSS rose by (heap freed before and reused counts as ``other``: docs/anatomy.md), so
    only their sign is asserted; the rest is exact."""
    model, optimizer = _model()
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    monitor.track(model, optimizer)
    truth: list[int] = []
    _loop(model, optimizer, monitor, 1)
    monitor.local_metrics()
    _loop(model, optimizer, monitor, 1, after=lambda step: truth.append(optimizer_bytes(optimizer)))
    values = monitor.local_metrics()
    monitor.close()
    s = split(values, "update")
    assert "slack" not in s and set(s) == set(PARTS) - {"slack"}
    assert s["params"] == sum(p.numel() * 4 for p in model.parameters())
    assert s["optimizer"] == truth[-1] == 2 * s["params"]
    # On the host the RSS peak may fall in any segment of the step (the heap reuses what was freed): the
    # range's ends are then the gradients alive at that segment's edges, none or all of them.
    assert s["grads_low"] <= s["grads_high"] and {s["grads_low"], s["grads_high"]} <= {0, s["params"]}
    total = s["params"] + s["optimizer"] + s["grads_high"] + s["activations"] + s["other"]
    assert total == pytest.approx(values["mem/phase/update/peak_rss_gib"] * GIB, rel=1e-12)
    assert s["activations"] >= 0 and grad_bytes(model.parameters()) == 0


def test_untracked_monitor_has_no_anatomy() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    with monitor.step(0), monitor.phase("update"):
        monitor.micro_batch(10)
    values = monitor.local_metrics()
    monitor.close()
    assert "mem/phase/update/peak_rss_gib" in values and not any("/anatomy/" in k for k in values)
    assert monitor.tracker is None


def test_ptrs_name_the_tracked_storages() -> None:
    model, optimizer = _model()
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    monitor.track(model, optimizer)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    tracker = monitor.tracker
    assert tracker is not None
    ptrs = tracker.ptrs()
    monitor.close()
    assert ptrs["params"] == {p.untyped_storage().data_ptr() for p in model.parameters()}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert ptrs["grads"] == {g.untyped_storage().data_ptr() for g in grads}
    assert len(ptrs["optimizer"]) == 2 * len(ptrs["params"])  # AdamW's two moments per parameter


def test_gradient_bytes_where_no_walk_reads_them() -> None:
    """The gradient count skips its walk after the ``zero_grad`` of an optimizer that holds every tracked
    parameter, and while every parameter holds a gradient: each figure equals the bytes counted directly,
    through a second backward, frees, zeroing in place, a module's ``zero_grad``, and then a second model
    with its own optimizer (the first one's ``zero_grad`` leaves the second's gradients)."""
    import inspect

    actor, critic = _model()[0], _model()[0]
    actor_opt, critic_opt = torch.optim.AdamW(actor.parameters()), torch.optim.SGD(critic.parameters())
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    monitor.track(actor, actor_opt)
    tracker = monitor.tracker
    assert tracker is not None
    half = sum(p.numel() * 4 for p in actor.parameters())
    seen: list[tuple[int, int]] = []

    def after(*calls: Any) -> None:
        for call in calls:
            call()
        seen.append((tracker.grads(), grad_bytes([*actor.parameters(), *critic.parameters()])))

    def backward(m: torch.nn.Module) -> None:
        m(torch.randn(8, 256)).square().sum().backward()

    after(lambda: backward(actor))
    after(lambda: backward(actor))  # every parameter holds one
    after(actor_opt.step, actor_opt.zero_grad)
    after(lambda: backward(actor), lambda: actor_opt.zero_grad(set_to_none=False))
    after(actor.zero_grad)  # the module's, not the optimizer's
    monitor.track(critic, critic_opt)
    after(lambda: backward(actor), lambda: backward(critic))
    after(critic_opt.zero_grad)  # the watched gradient (the actor's) stays: nothing to read from it
    after(actor_opt.zero_grad)  # no longer every tracked parameter's optimizer
    assert [truth for _, truth in seen] == [half, half, 0, half, 0, 2 * half, half, 0]
    assert [mine for mine, _ in seen] == [truth for _, truth in seen]
    assert "set_to_none" in inspect.signature(actor_opt.zero_grad).parameters  # accelerate reads it
    monitor.close()
    assert "zero_grad" not in vars(actor_opt) and "zero_grad" not in vars(critic_opt)


def test_prometheus_names_the_part_in_a_category_label() -> None:
    from rankmem.core.records import StepRecord
    from rankmem.sinks._promfigures import Figures

    keys = [f"mem/phase/update/anatomy/{p}_gib" for p in ("params", "activations")]
    metrics = {f"{k}/{stat}": v for k, v in zip(keys, (0.5, 2.0), strict=True)
               for stat in ("max", "min", "mean")}
    metrics.update({f"{k}/max_rank": 1.0 for k in keys})
    record = StepRecord(step=3, time=1.0, metrics=metrics, keys=keys)
    families = {f.name: f for f in Figures("job", 2).families(record, None, [], 2, {})}
    family = families["rankmem_phase_anatomy_bytes"]
    assert family.labels == ("job", "stat", "phase", "category")
    assert (("job", "max", "update", "activations"), 2.0 * GIB) in family.samples
    assert (("job", "mean", "update", "params"), 0.5 * GIB) in family.samples
    worst = families["rankmem_worst_rank"].samples
    assert (("job", "rankmem_phase_anatomy_bytes:activations", "update"), 1.0) in worst


def test_advice_fits_the_part_that_follows_the_work(tmp_path: Path) -> None:
    """Two micro-batches of accumulation whose heavier one runs first or second at random: the second's
    peak carries the gradients, noise against tokens. Fitted on what follows the work (the anatomy's), the
    residual noise is a fraction of the fit on the whole rise, and the prediction at the peak still holds."""
    import random

    import numpy as np

    from rankmem.fit.model import FitConfig
    from rankmem.offline import read_run
    from rankmem.offline.advice import fit_ranks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    cuda = TensorCuda()
    monitor = rankmem.Monitor(device="cuda", device_module=cuda, children=False, near_oom_watch=False,
                              nvml_refresh_s=None, out_dir=str(tmp_path))
    params = list(model.parameters())
    mirror = Mirror(cuda, params)
    mirror.adopt(params)
    monitor.track(model, optimizer)
    draw = random.Random(3)
    with mirror:
        for step in range(24):
            heavy = draw.choice((384, 640, 896, 1152, 1408))
            pair = [heavy, 256] if draw.random() < 0.5 else [256, heavy]
            with monitor.step(step), monitor.phase("update"):
                for tokens in pair:
                    monitor.micro_batch(tokens)
                    model(torch.randn(tokens, 256)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            monitor.collect()
    monitor.close()
    run = read_run(str(tmp_path))
    exact = FitConfig(noise_floor=1e-9)  # the default floor (1 MiB) would hide the difference at this size
    (ours,) = fit_ranks(run, "update", warmup=1, config=exact)
    for part in ("grads_low", "grads_high", "optimizer"):
        del run.series[f"mem/phase/update/anatomy/{part}_gib"]
    (whole,) = fit_ranks(run, "update", warmup=1, config=exact)
    assert ours.model.scale < whole.model.scale / 4, (ours.model.scale, whole.model.scale)
    peaks = run.series["mem/phase/update/peak_allocated_gib"][1:, 0]
    tokens = run.series["mem/phase/update/heaviest_mb_tokens"][1:, 0]
    predicted = np.array([ours.peak(t)[2] for t in tokens])  # the interval's high end, against capacity
    assert (predicted >= peaks - 1e-6).all()


def test_readme_section_command_prints_the_split(tmp_path: Path) -> None:
    """README's "What fills the peak": the reference job's report line, its shape and its exact parts
    (the GPT's parameters in fp32 and AdamW's two moments), and README shows such a line."""
    import re
    import subprocess
    import sys

    from rankmem.engine.model import GPT, GPTConfig
    from rankmem.engine.tasks import GRPO_VOCAB

    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--steps", "3",
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "rankmem", "report", str(out)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    line = re.compile(r"what fills the update peak \(MiB, step \d+\): rank \d: params ([\d.]+), "
                      r"optimizer ([\d.]+), grads [\d.-]+, activations [\d.]+, other [\d.]+; "
                      r"median rank \d: .*; most is \w+: ")
    found = line.search(report.stdout)
    assert found is not None, report.stdout
    params = sum(p.numel() * 4 for p in GPT(GPTConfig(vocab_size=GRPO_VOCAB)).parameters()) / MIB
    assert float(found.group(1)) == pytest.approx(params, abs=0.05)
    assert float(found.group(2)) == pytest.approx(2 * params, abs=0.05)
    assert line.search((REPO / "README.md").read_text()) is not None
