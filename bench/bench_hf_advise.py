"""The advice on a Hugging Face Trainer job: a tiny random Llama, padded micro-batches, gradient
accumulation 2, 2 gloo ranks on the CPU, host memory standing in for the device; ``attach(trainer)`` alone.

Run:  python bench/bench_hf_advise.py --seeds 3                  (SDPA and eager, ~2-4 min per seed each)
      python bench/bench_hf_advise.py --seeds 1 --attention eager
(it launches ``python -m torch.distributed.run --nproc-per-node 2 bench/bench_hf_advise.py --worker ...`` with
glibc set as ``rankmem train`` sets it, and the worker hands freed heap back after each step: docs/advice.md).

Per seed and attention path, in one job (the same processes, so the same baseline):

1. probe: a Trainer whose micro-batches hold B rows (B drawn from 8..32) of random lengths 16..64, padded to
   the longest (run log ``probe``); each optimizer step accumulates 2 micro-batches;
2. sweep: a second Trainer on micro-batches of B rows padded to 64 (the job's max length), B from 32 (the
   probe's top) to 48 (run log ``sweep``).

Each rank draws its own micro-batches; the Trainer's loader (accelerate) shards the list over the 2
ranks and goes through it twice in ``max_steps``, so each rank's probe is 12 distinct steps run twice,
and each B of the sweep runs 2 steps per rank.

Offline: the capacity is the highest rank's probe baseline (its lowest RSS between steps after warm-up) plus
1.25x the largest rise the probe saw; ``rankmem advise probe --capacity C --headroom 0`` gives the advised
tokens and ``TrainingArguments.per_device_train_batch_size``; the true largest safe budget is the largest B
of the sweep below which every step's ``train_step`` peak fit under C on both ranks, times 64 tokens.

The prediction at 1.5x: per rank, T* is the sweep's largest T at or below 1.5x the largest T its probe saw
(after warm-up); ``rankmem advise probe --at-tokens T* --seq-len 64`` gives the predicted peak, set against
the peak RSS the sweep measured at T*, as a share of the measured rise (that peak less the probe's baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH = 64
GLIBC = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "131072",
         "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "OMP_NUM_THREADS": "1"}


def worker(out: str, seed: int, attention: str, probe_steps: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from rankmem.engine.hostheap import release_freed_heap
    from rankmem.integrations.hf import attach

    rank = int(os.environ["RANK"])
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=WIDTH,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attention)
    rng = np.random.default_rng(seed * 1000 + rank)

    def micro_batch(rows: int, width: int | None) -> dict[str, Any]:
        lengths = rng.integers(16, WIDTH + 1, size=rows)
        if width is None:
            width = int(lengths.max())
        else:
            lengths[0] = width  # padded to the job's max length: the longest row is that long
        ids = torch.randint(3, config.vocab_size, (rows, width))
        mask = (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).long()
        return {"input_ids": ids.masked_fill(mask == 0, 2), "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}

    class Trim(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            release_freed_heap()

    def train(name: str, batches: list[dict[str, Any]]) -> None:
        args = TrainingArguments(
            output_dir=os.path.join(out, "hf"), max_steps=len(batches) // 2, per_device_train_batch_size=1,
            gradient_accumulation_steps=2, logging_steps=500, use_cpu=True, report_to=[], ddp_backend="gloo",
            save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
            ddp_find_unused_parameters=False, seed=seed)
        # Each item is a whole micro-batch; the loader's batch of one is unwrapped.
        trainer = Trainer(model=model, args=args, train_dataset=batches, data_collator=lambda items: items[0],
                          callbacks=[Trim()])
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(batches)
        attach(trainer, out_dir=os.path.join(out, name), sinks=("jsonl",), near_oom_watch=False)
        trainer.train()

    probe = [micro_batch(int(rng.integers(8, 33)), None) for _ in range(2 * probe_steps)]
    train("probe", probe)
    largest = 32  # the probe's top B on every rank: the ranks' sweeps (and step counts) must be the same
    sweep = [micro_batch(rows, WIDTH) for rows in range(largest, int(1.5 * largest) + 1) for _ in range(2)]
    train("sweep", sweep)


def evaluate(out: str) -> dict[str, Any]:
    from rankmem.core.catalogue import key_of, phase_key, work_key
    from rankmem.offline import read_run

    probe, sweep = read_run(os.path.join(out, "probe")), read_run(os.path.join(out, "sweep"))
    rss = probe.series[key_of("rss")][2:]
    peak = probe.series[phase_key("train_step", "peak_rss_gib")][2:]
    base = np.nanmin(rss, axis=0)
    capacity = float(base.max() + 1.25 * np.nanmax(peak - base[None, :]))
    argv = ["advise", os.path.join(out, "probe"), "--capacity", f"{capacity:.6f}", "--headroom", "0",
            "--json"]
    done = subprocess.run([sys.executable, "-m", "rankmem", *argv], capture_output=True, text=True,
                          timeout=300)
    rows = json.loads(done.stdout) if done.returncode in (0, 3) and done.stdout.startswith("[") else []
    binding = next((r for r in rows if r.get("binding")), None)
    tokens = sweep.series[work_key("train_step", "mb_tokens")].max(axis=1)
    fits = (sweep.series[phase_key("train_step", "peak_rss_gib")] <= capacity).all(axis=1)
    safe = 0
    for t in sorted(set(tokens.tolist())):
        if not fits[tokens == t].all():
            break
        safe = int(t)
    advised = binding["max_tokens"] if binding else None
    return {"capacity_gib": capacity, "advised_tokens": advised, "true_tokens": safe,
            "advised_batch_size": next(iter(binding["setting"].values()), None) if binding else None,
            "true_batch_size": safe // WIDTH,
            "capped": binding["capped"] if binding else None, "sweep_top": int(tokens.max()),
            "reason": None if binding else done.stdout[-300:] + done.stderr[-300:],
            "at_1_5x": at_one_and_a_half(out, probe, sweep, base)}


def at_one_and_a_half(out: str, probe: Any, sweep: Any, base: np.ndarray) -> dict[str, Any]:
    """Per rank: T*, its ratio to the largest T seen, the predicted and measured peak (GiB) and the error
    as a share of the measured rise."""
    from rankmem.core.catalogue import phase_key, work_key

    seen = np.nanmax(probe.series[work_key("train_step", "mb_tokens")][2:], axis=0)
    tokens = sweep.series[work_key("train_step", "mb_tokens")]
    peaks = sweep.series[phase_key("train_step", "peak_rss_gib")]
    ranks = []
    for rank, largest in enumerate(seen):
        at = float(np.max(tokens[:, rank][tokens[:, rank] <= 1.5 * largest]))
        argv = ["advise", os.path.join(out, "probe"), "--at-tokens", f"{at:.0f}", "--seq-len", str(WIDTH), "--json"]
        done = subprocess.run([sys.executable, "-m", "rankmem", *argv], capture_output=True, text=True, timeout=300)
        row = next(r for r in json.loads(done.stdout) if r["rank"] == rank)
        measured = float(np.max(peaks[tokens[:, rank] == at, rank]))
        predicted = row.get("predicted_peak_gib", np.nan)
        ranks.append({"tokens": at, "times_seen": at / largest, "predicted_gib": predicted, "measured_gib": measured,
                      "of_rise": (predicted - measured) / (measured - base[rank])})
    return {"at_1_5x": ranks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--attention", choices=("sdpa", "eager"), action="append")
    parser.add_argument("--probe-steps", type=int, default=24)
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "SEED", "ATTENTION"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2], args.probe_steps)
        return
    sys.path.insert(0, os.path.dirname(HERE))
    from bench._torchrun import free_port

    results = []
    for attention in args.attention or ["sdpa", "eager"]:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            out = tempfile.mkdtemp(prefix=f"hf-advise-{attention}-{seed}-")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", __file__,
                   "--probe-steps", str(args.probe_steps), "--worker", out, str(seed), attention]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                                  env={**os.environ, **GLIBC})
            if proc.returncode != 0:
                with open(os.path.join(out, "stderr.txt"), "w") as f:
                    f.write(proc.stderr)
                print(attention, seed, f"failed (exit {proc.returncode}): its output in {out}/stderr.txt")
                continue
            row = {"attention": attention, "seed": seed, **evaluate(out)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for unit in ("tokens", "batch_size"):
        ratios = [r[f"advised_{unit}"] / r[f"true_{unit}"] for r in results
                  if r[f"advised_{unit}"] and r[f"true_{unit}"]]
        if ratios:
            print(f"advised / true largest safe ({unit}): min {min(ratios):.3f} "
                  f"median {float(np.median(ratios)):.3f} "
                  f"max {max(ratios):.3f}; over in {sum(r > 1 for r in ratios)} of {len(ratios)}")
    errors = [a["of_rise"] for r in results for a in r["at_1_5x"]]
    if errors:
        print(f"predicted - measured peak at ~1.5x the largest T seen, share of the rise, per rank: "
              f"{' '.join(f'{e:+.3f}' for e in errors)}; within 5% in {sum(abs(e) <= 0.05 for e in errors)} "
              f"of {len(errors)}")


if __name__ == "__main__":
    main()
