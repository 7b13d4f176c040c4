"""The always-on peak anatomy on a real CUDA device: the split against what torch says, and its cost.

    python scripts/anatomy_tier_a.py          # on a machine with a CUDA GPU (about a minute)

The reference GPT on the device, AdamW, two micro-batches of accumulation (the second heavier) per step
in an ``update`` phase and a forward-only ``log_prob`` phase. Checked per step after the first:
``params`` and ``optimizer`` equal the bytes computed from the model and optimizer (to 0.01 MiB);
the split sums to the phase's ``peak_allocated``, which equals ``torch.cuda.max_memory_allocated``
over the phase; ``log_prob``'s gradient range is closed; ``slack`` = peak reserved - peak allocated.
Then the cost: the training thread's CPU time per step with and without ``track()``. Exit 0 when
every check holds, 1 otherwise; 0 at once without a GPU.
"""

from __future__ import annotations

import sys
import time

import torch

import rankmem
from rankmem.engine.model import GPT, GPTConfig

MIB = 2**20
GIB = 2**30


def run(track: bool, steps: int) -> tuple[list[str], float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32768, block_size=512, n_layer=8, n_head=8, n_embd=512)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    monitor = rankmem.Monitor(device="cuda", children=False, near_oom_watch=False)
    if track:
        monitor.track(model, optimizer)
    failures: list[str] = []
    spent = 0.0
    for step in range(steps):
        cpu = time.thread_time()
        peaks = {}
        with monitor.step(step):
            for phase in ("update", "log_prob"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                with monitor.phase(phase):
                    if phase == "update":
                        for rows in (4, 8):
                            monitor.micro_batch(rows * 512)
                            ids = torch.randint(0, 32768, (rows, 512), device="cuda")
                            model(ids).float().logsumexp(-1).sum().backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    else:
                        with torch.no_grad():
                            monitor.micro_batch(8 * 512)
                            model(torch.randint(0, 32768, (8, 512), device="cuda")).sum()
                    torch.cuda.synchronize()
                peaks[phase] = torch.cuda.max_memory_allocated()
        values = monitor.local_metrics()
        spent += time.thread_time() - cpu
        if not track or step == 0:
            continue
        params = sum(p.untyped_storage().nbytes() for p in model.parameters())
        state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if v.dim() >= 1)
        for phase, peak in peaks.items():
            split = {k.rsplit("/", 1)[1][: -len("_gib")]: v * 2**30 for k, v in values.items()
                     if k.startswith(f"mem/phase/{phase}/anatomy/")}
            mine = values[f"mem/phase/{phase}/peak_allocated_gib"] * GIB
            reserved = values[f"mem/phase/{phase}/peak_reserved_gib"] * GIB
            total = split["params"] + split["optimizer"] + split["grads_high"] + split["activations"]
            checks = {
                "params": abs(split["params"] - params) <= 0.01 * MIB,
                "optimizer": abs(split["optimizer"] - state) <= 0.01 * MIB or split["optimizer"] == 0,
                "peak = max_memory_allocated": mine == peak,
                "sum = peak": abs(total - mine) < 1,
                "slack": abs(split["slack"] + mine - reserved) < 1,
                "closed range": phase != "log_prob" or split["grads_low"] == split["grads_high"],
            }
            failures += [f"step {step} {phase}: {name} ({split})" for name, ok in checks.items() if not ok]
            parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in split.items())
            print(f"step {step} {phase}: {parts} MiB")
    monitor.close()
    return failures, spent / steps


def main() -> int:
    if not torch.cuda.is_available():
        print("anatomy_tier_a: no CUDA device; nothing to check")
        return 0
    _, off = run(False, 6)
    failures, on = run(True, 6)
    print(f"training thread CPU per step: without track {off * 1e3:.2f} ms, with {on * 1e3:.2f} ms "
          f"({(on - off) * 1e3:+.2f} ms)")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
