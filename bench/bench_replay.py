"""The allocator-history replay's own cost: 50,000 entries of the reference GPT's forward and backward.

Run:  python bench/bench_replay.py [--entries 50000]

No GPU needed: the test recorder (tests/anatomy_recorder.py) writes the CPU run as CUDA allocator
history, with Python frames and module tags. Times ``replay`` with the baseline's mark in the ring
(the sampled window's case) and with a ring that wrapped past it (the start undone from the end).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rankmem.engine.model import GPT, GPTConfig  # noqa: E402
from rankmem.forensics.replay import replay  # noqa: E402
from rankmem.forensics.sampler import ModuleTags  # noqa: E402
from tests.anatomy_recorder import Recorder  # noqa: E402


def recorded(entries: int, ring: int) -> tuple[object, dict[str, object]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_embd=64))
    idx = torch.randint(0, 512, (2, 64))
    rec = Recorder(max_entries=ring)
    rec.adopt(*model.parameters(), idx)
    tags = ModuleTags(rec.set_metadata, lambda: "update")
    tags.name(model)
    with rec:
        tags.install()
        baseline = rec.segments()
        while len(rec.trace) < entries:
            model(idx).sum().backward()
        tags.remove()
        return baseline, rec.snapshot()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=50_000)
    args = p.parse_args()
    for name, ring in (("whole window", int(args.entries * 1.2)), ("wrapped ring", args.entries)):
        baseline, snap = recorded(args.entries, ring)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            found = replay(snap, baseline)  # type: ignore[arg-type]
            times.append(time.perf_counter() - start)
        print(f"{name}: {found['entries']} entries, wrapped {found['wrapped']}: replay "
              f"min {min(times) * 1e3:.0f} ms, median {statistics.median(times) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
