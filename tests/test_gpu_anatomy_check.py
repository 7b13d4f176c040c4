"""scripts/gpu_anatomy_check.py off the GPU: its dry run, and its judging on a CPU run's real replay
(tests/anatomy_recorder.py writes it as allocator history), so the device run tests the replay, not
the judge (scripts/gpu_check.sh runs it for real on a CUDA device)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import torch

from rankmem.engine.model import GPT, GPTConfig
from rankmem.forensics.replay import replay
from rankmem.forensics.sampler import addresses
from tests.anatomy_recorder import Recorder
from tests.conftest import REPO

SCRIPT = REPO / "scripts/gpu_anatomy_check.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_anatomy_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_checks_its_arguments_and_exits() -> None:
    run = [sys.executable, str(SCRIPT), "--dry-run"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0
    assert done.stdout == "gpu_anatomy_check: dry run: 8 layers, 4096 tokens, max cost 1.3\n"
    done = subprocess.run([*run, "--tokens", "8"], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "--tokens >= 16, --layers >= 1 and --max-cost > 1" in done.stderr


def test_the_judges_pass_a_true_replay_and_name_a_one_byte_miss() -> None:
    check = _script()
    torch.manual_seed(0)
    vocab, tokens = 4096, 64
    model = GPT(GPTConfig(vocab_size=vocab, block_size=tokens, n_layer=1, n_head=2, n_embd=64))
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, vocab, (1, tokens))
    model(idx).sum().backward()
    opt.step()
    rec = Recorder()
    state = [v for s in opt.state.values() for v in s.values()]
    rec.adopt(*model.parameters(), *[p.grad for p in model.parameters()], *state, idx)
    with rec, torch.no_grad():
        baseline = rec.segments()
        check.log_prob(model, idx)  # the script's own log_prob, on the CPU
        snap = rec.snapshot()
    owned = addresses([(model, opt)], lambda t: rec.by_storage[id(t.untyped_storage())])
    found = replay(snap, baseline, owned)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    held = sum(v.untyped_storage().nbytes() for v in state if v.ndim >= 1)
    assert check.judge_exact(found, rec.peak, params, held) == []
    assert check.judge_logits(found, tokens, vocab) == []
    (miss,) = check.judge_exact(found, rec.peak + 1, params, held)
    assert miss.startswith(f"baseline + rise {found['baseline_bytes']} + ")
    assert miss.endswith(f"max_memory_allocated {rec.peak + 1} B")
    assert check.judge_logits(found, 2 * tokens, vocab)[0].startswith("top temporary")
