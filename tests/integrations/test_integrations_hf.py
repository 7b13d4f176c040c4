"""Hugging Face Trainer integration, with a real ``transformers.Trainer`` on a tiny random GPT-2 (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rankmem.offline import read_run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
KEYS = ("mem/host/rss_gib", "mem/host/peak_rss_gib", "mem/phase/train_step/peak_rss_gib")


def _statm_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def tiny_trainer(tmp_path: Path, model_class: Any = None, samples: int = 32, callbacks: Any = None,
                 **arguments: Any) -> Any:
    """A Trainer over a tiny random GPT-2 (``model_class``, a subclass, to make it fail) on ``samples``
    random sequences, on the CPU, logging every step; ``arguments`` override the TrainingArguments."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = (model_class or GPT2LMHeadModel)(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128,
                                                        n_positions=32))
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 128, (samples, 16))]
    options = {"output_dir": str(tmp_path / "hf"), "max_steps": 3, "per_device_train_batch_size": 4,
               "logging_steps": 1, "use_cpu": True, "report_to": [], "save_strategy": "no", "disable_tqdm": True,
               **arguments}
    return Trainer(model=model, args=TrainingArguments(**options), train_dataset=data, callbacks=callbacks)


def _check_entry(entry: dict[str, Any], world: int) -> None:
    for key in KEYS:
        lo, mean, hi = entry[key + "/min"], entry[key + "/mean"], entry[key + "/max"]
        assert 0.05 < lo <= mean <= hi < 8, (key, lo, mean, hi)
        assert entry[key + "/max_rank"] in range(world)
    assert entry["mem/host/peak_rss_gib/max"] >= entry["mem/host/rss_gib/max"]
    assert entry["mem/host/peak_rss_gib/min"] >= entry["mem/host/rss_gib/min"]


def test_trainer_single_process(tmp_path: Path) -> None:
    from rankmem.integrations.hf import RankmemCallback, attach

    trainer = tiny_trainer(tmp_path, output_dir=str(tmp_path))
    data = trainer.train_dataset
    cb = attach(trainer)
    order = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert order.index("RankmemCallback") == order.index("DefaultFlowCallback") + 1
    trainer.train()
    statm = _statm_rss_gib()

    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2, 3]
    for entry in steps:
        _check_entry(entry, world=1)
        assert entry["mem/host/rss_gib/max_rank"] == 0
    # The last window ended moments ago: its RSS is this process's RSS now, within 64 MiB.
    assert abs(cb.last_metrics["mem/host/rss_gib/max"] - statm) < 1 / 16
    assert isinstance(cb, RankmemCallback)

    # evaluate() after train(): the callback closed its monitor at train end and builds a fresh one,
    # so the eval log still carries live figures.
    trainer.evaluate(eval_dataset=data[:8])
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 1
    assert abs(evals[0]["mem/host/rss_gib/max"] - _statm_rss_gib()) < 1 / 16


def test_an_oom_leaving_train_is_an_event_at_its_step(tmp_path: Path) -> None:
    import numpy as np
    from transformers import GPT2LMHeadModel

    from rankmem.forensics.heartbeat import read_heartbeats
    from rankmem.integrations.hf import attach
    from rankmem.offline.events import read_events

    class RunsOutInTheThirdStep(GPT2LMHeadModel):  # type: ignore[misc]
        forwards = 0

        def forward(self, **kwargs: Any) -> Any:
            type(self).forwards += 1
            if type(self).forwards == 3:
                np.ones(1 << 62, dtype=np.uint8)  # a real MemoryError (4 EiB)
            return super().forward(**kwargs)

    trainer = tiny_trainer(tmp_path, RunsOutInTheThirdStep, max_steps=5, remove_unused_columns=False)
    cb = attach(trainer, out_dir=str(tmp_path), near_oom_watch=False)
    attach(trainer, cb)  # twice: train is wrapped once
    with pytest.raises(MemoryError):
        trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2]
    (event,) = read_events(str(tmp_path)).events
    assert (event.kind, event.where, event.step, event.phase) == ("oom", "host", 3, "train_step")
    # The callback's own monitor was closed, as by a failure: its heartbeat says the exit was not clean.
    assert cb.monitor is None
    beat = read_heartbeats(str(tmp_path / "heartbeat"))[0]
    assert beat.step == 3 and beat.phase == "train_step" and not beat.clean


def test_an_oom_auto_find_batch_size_retries_is_still_an_event(tmp_path: Path) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    from rankmem.integrations.hf import attach
    from rankmem.offline.events import read_events

    class TooBigAtBatch8(GPT2LMHeadModel):  # type: ignore[misc]
        def forward(self, **kwargs: Any) -> Any:
            if kwargs["input_ids"].shape[0] == 8:
                torch.empty(1 << 60, dtype=torch.uint8)  # torch's CPU allocator refuses 1 EiB
            return super().forward(**kwargs)

    trainer = tiny_trainer(tmp_path, TooBigAtBatch8, max_steps=2, per_device_train_batch_size=8,
                           remove_unused_columns=False, auto_find_batch_size=True)
    attach(trainer, out_dir=str(tmp_path), near_oom_watch=False)
    trainer.train()  # accelerate takes the OOM, shrinks the batch (to 7) and trains on
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2]
    (event,) = read_events(str(tmp_path)).events
    assert (event.kind, event.where, event.step, event.phase) == ("oom", "host", 1, "train_step")
    assert event.requested_bytes == 1 << 60


def test_importing_rankmem_imports_no_framework() -> None:
    code = "import sys, rankmem; print(sorted(m for m in ('transformers', 'lightning', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_framework_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import rankmem.integrations.hf\nexcept ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == (
        "MissingExtraError rankmem.integrations.hf needs transformers, which is not installed: "
        "pip install 'rankmem[hf]'"
    )


# ---- attach() of a callback already in the Trainer's list moves it: one collect per on_log ----------

def test_hf_attach_twice_collects_once_per_log(tmp_path: Path) -> None:
    """A callback passed in callbacks= and then attach()ed is moved, not added twice: twice, every
    on_log would run two collects, the second one's near-empty window overwriting the step's figures."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    from rankmem.integrations.hf import RankmemCallback, attach

    cb = RankmemCallback(out_dir=str(tmp_path / "run"), sinks=("jsonl",), near_oom_watch=False)
    trainer = tiny_trainer(tmp_path, samples=16, max_steps=2, callbacks=[cb])
    attach(trainer, cb)  # "puts the callback ahead of the trackers"
    trainer.train()
    run = read_run(str(tmp_path / "run"))
    # One collect per step: the final summary's on_log adds the last one's figures, it collects nothing.
    assert run.steps.tolist() == [1, 2]
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary
    assert summary["mem/host/rss_gib/max"] == cb.last_metrics["mem/host/rss_gib/max"]
    assert sum(c is cb for c in trainer.callback_handler.callbacks) == 1


def test_ranks_reach_log_history_as_ints_and_the_example_is_quiet(tmp_path: Path) -> None:
    """``.../max_rank`` is ``0``, not ``0.0``, in ``log_history`` (and so in its JSON); the example prints
    no warning of transformers, accelerate or DDP before its own lines."""
    import json

    from rankmem.integrations.hf import ranks_as_ints

    converted = ranks_as_ints({"a/max_rank": 3.0, "a/max": 3.0, "b/min_rank": float("nan")})
    assert type(converted["a/max_rank"]) is int and converted["a/max_rank"] == 3
    assert type(converted["a/max"]) is float and converted["b/min_rank"] != converted["b/min_rank"]  # NaN kept
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "examples/hf_example.py", "--out", str(out), "--steps", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.splitlines()[0].startswith("{'loss': ")
    history = json.loads((out / "log_history.json").read_text())
    ranks = [v for e in history for k, v in e.items() if k.endswith("_rank")]
    assert ranks and all(type(v) is int for v in ranks), history


def test_a_failing_step_close_after_train_raised_warns_once_and_the_trainers_error_propagates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper of trainer.train is a clean-up that re-raises: telemetry failing in it (a boundary of
    rankmem.core.guard) is one warning, and what the Trainer raised is what the caller sees."""
    from types import SimpleNamespace

    from rankmem.errors import RankmemError
    from rankmem.integrations.hf import RankmemCallback, _recording_failures

    cb = RankmemCallback(device="cpu", near_oom_watch=False)

    def close_step(exc: BaseException | None = None) -> None:
        raise RankmemError("the step's window is not open")

    monkeypatch.setattr(cb, "_close_step", close_step)

    def train() -> None:
        raise ValueError("the Trainer's own error")

    trainer = SimpleNamespace(train=train, callback_handler=SimpleNamespace(callbacks=[cb]))
    wrapped = _recording_failures(trainer, "train", close=True)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(2):
            with pytest.raises(ValueError, match="the Trainer's own error"):
                wrapped()
    assert [str(w.message) for w in caught] == [
        "rankmem: closing the step after train() raised failed: RankmemError(\"the step's window is not open\")"]


# Sequence lengths of 16 examples, right-padded to 16 positions: 4 micro-batches of 4 rows, 2 per step.
HF_LENGTHS = [16, 3, 9, 12, 5, 16, 7, 2, 11, 14, 6, 8, 10, 4, 13, 1]
HF_WIDTH = 16


def _work_trainer(tmp_path: Path, fed: list[list[int]], as_lists: bool = False, **options: Any) -> Any:
    """A Trainer over padded examples whose collator records which lengths each micro-batch got (the
    sampler shuffles); ``as_lists`` collates plain lists, which a compute_loss override turns into tensors."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    from rankmem.integrations.hf import attach

    torch.manual_seed(0)
    examples = []
    for idx, n in enumerate(HF_LENGTHS):
        ids = torch.randint(0, 127, (HF_WIDTH,))
        mask = (torch.arange(HF_WIDTH) < n).long()
        examples.append({"idx": idx, "input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0,
                                                                                                         -100)})

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        fed.append([HF_LENGTHS[f["idx"]] for f in features])
        batch = default_data_collator([{k: v for k, v in f.items() if k != "idx"} for f in features])
        return {k: v.tolist() for k, v in batch.items()} if as_lists else batch

    class ListTrainer(Trainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(model, {k: torch.tensor(v) for k, v in inputs.items()}, *args, **kwargs)

        def floating_point_ops(self, inputs: dict[str, Any]) -> int:
            return 0  # the Trainer's own estimate reads input_ids.numel()

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                       bos_token_id=127, eos_token_id=127))
    model.loss_type = "ForCausalLM"
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, logging_steps=1, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = (ListTrainer if as_lists else Trainer)(model=model, args=args, train_dataset=examples,
                                                     data_collator=collate)
    attach(trainer, out_dir=str(tmp_path / "run"), sinks=("jsonl",), near_oom_watch=False, **options)
    return trainer


def test_each_micro_batch_s_padded_positions_reach_the_run_log_as_work(tmp_path: Path) -> None:
    """Every position of a padded micro-batch is work (the model computes on the padding), read from its
    shape; the header names the framework and the batches padded, for the advice's units."""
    from rankmem.core.catalogue import WORK_FIELDS, work_key

    fed: list[list[int]] = []
    _work_trainer(tmp_path, fed).train()
    assert sorted(n for mb in fed for n in mb) == sorted(HF_LENGTHS) and len(fed) == 4
    run = read_run(str(tmp_path / "run"))
    assert run.steps.tolist() == [1, 2]
    for row in range(2):  # gradient accumulation: 2 micro-batches of 4 rows a step, each padded to 16
        got = {f: run.series[work_key("train_step", f)][row, 0] for f in WORK_FIELDS}
        assert got == {"mb_tokens": 4 * HF_WIDTH, "mb_sequences": 4, "mb_sq_tokens": 4 * HF_WIDTH**2,
                       "tokens": 2 * 4 * HF_WIDTH, "micro_batches": 2}, row
    assert run.header.config["run"]["framework"] == {"name": "hf", "batches": "padded"}


def test_every_n_steps_collects_each_nth_step_and_the_rest_at_train_end(tmp_path: Path) -> None:
    from rankmem.integrations.hf import attach

    trainer = tiny_trainer(tmp_path, max_steps=5, logging_steps=500)
    cb = attach(trainer, out_dir=str(tmp_path / "run"), sinks=("jsonl",), near_oom_watch=False,
                every_n_steps=2)
    trainer.train()
    assert read_run(str(tmp_path / "run")).steps.tolist() == [2, 4, 5]
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        type(cb)(every_n_steps=0)


def test_inputs_that_are_not_tensors_train_on_with_one_warning(tmp_path: Path) -> None:
    import warnings

    from rankmem.core.catalogue import work_key

    fed: list[list[int]] = []
    trainer = _work_trainer(tmp_path, fed, as_lists=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [str(w.message) for w in caught if str(w.message).startswith("rankmem:")]
    assert ours == ["rankmem: the Trainer's inputs hold no 2-D 'input_ids' or 'attention_mask' (got dict): "
                    "micro-batch work is not recorded, so rankmem advise has no tokens to fit against"]
    assert len(fed) == 4 and trainer.state.global_step == 2
    run = read_run(str(tmp_path / "run"))
    assert work_key("train_step", "mb_tokens") not in run.series  # not told: absent, never 0
    assert "mem/phase/train_step/peak_rss_gib" in run.series
