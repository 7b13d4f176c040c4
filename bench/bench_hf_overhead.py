"""Wall-time overhead of rankmem's HF Trainer callback: the same Trainer run with it on and off.

Run:  OMP_NUM_THREADS=1 python bench/bench_hf_overhead.py --repeats 5 --steps 60

Runs alternate (off, on, off, on, ...) in one process so drift hits both arms alike; each run is a
fresh tiny GPT-2 Trainer on CPU, logging every step (the callback's worst case: a collect per step).
Reports the median difference per step against the run-to-run spread of the "off" arm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from rankmem.integrations.hf import attach


def run_once(steps: int, with_callback: bool, out: str) -> float:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (steps * 8, 32))]
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, logging_steps=1, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, log_level="error",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(trainer.callback_handler.callbacks[-1].__class__)  # the printer: no stdout cost
    if with_callback:
        attach(trainer)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as out:
        run_once(5, True, out)  # warm up imports and allocator in both code paths
        run_once(5, False, out)
        for _ in range(args.repeats):
            for arm in (False, True):
                times[arm].append(run_once(args.steps, arm, out))
    per_step = {arm: [t / args.steps * 1e3 for t in ts] for arm, ts in times.items()}
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    pairs = [b - a for a, b in zip(per_step[False], per_step[True], strict=True)]
    noise = statistics.stdev(per_step[False]) if args.repeats > 1 else float("nan")
    print(f"steps/run={args.steps} repeats={args.repeats} (one collect per step: logging_steps=1)")
    print(f"off: median {off:.3f} ms/step   on: median {on:.3f} ms/step")
    print(f"difference: {on - off:+.3f} ms/step ({(on - off) / off:+.2%}); paired median "
          f"{statistics.median(pairs):+.3f} ms/step")
    print(f"run-to-run noise (stdev of off runs): {noise:.3f} ms/step ({noise / off:.2%})")


if __name__ == "__main__":
    main()
