"""A Hugging Face Trainer job on a tiny random Llama (no download), padded micro-batches, rankmem attached
with ``attach(trainer)`` alone.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/hf_llama_worker.py OUT \
        [--steps 30] [--logging-steps 500] [--attn sdpa|eager] [--seed 0] [--accum 1] [--jump-step 10]

Each example is a random length in [--min-len, --max-len], and each micro-batch is padded to its longest
(as ``DataCollatorWithPadding`` does). ``--jump-step S``: rank 1 holds 64 MiB more during step S only.
``--trim``: glibc's freed heap handed back after each step (docs/advice.md), for a host fit.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from rankmem.engine.hostheap import release_freed_heap
from rankmem.integrations.hf import attach

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--logging-steps", type=int, default=500)
parser.add_argument("--attn", default="sdpa")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--min-len", type=int, default=16)
parser.add_argument("--max-len", type=int, default=128)
parser.add_argument("--vocab", type=int, default=2048)
parser.add_argument("--jump-step", type=int, default=0)
parser.add_argument("--trim", action="store_true")
args = parser.parse_args()

torch.manual_seed(args.seed)
rank = int(os.environ.get("RANK", "0"))
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=512,
                     bos_token_id=0, eos_token_id=1, pad_token_id=2)
model = LlamaForCausalLM._from_config(config, attn_implementation=args.attn)
rng = np.random.default_rng(args.seed * 100 + rank)
lengths = rng.integers(args.min_len, args.max_len + 1, size=args.steps * args.accum * args.batch * 2)
data = [{"input_ids": torch.randint(3, args.vocab, (int(n),))} for n in lengths]


def pad(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), 2, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Jump(TrainerCallback):  # type: ignore[misc]
    """Rank 1 holds 64 MiB more during one step; every rank hands freed heap back after each (--trim)."""

    held: Any = None

    def on_step_begin(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if rank == 1 and state.global_step + 1 == args.jump_step:
            self.held = np.ones(64 << 20, dtype=np.uint8)

    def on_step_end(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.held = None
        if args.trim:
            release_freed_heap()


training = TrainingArguments(
    output_dir=os.path.join(args.out, "hf"), max_steps=args.steps, per_device_train_batch_size=args.batch,
    gradient_accumulation_steps=args.accum, logging_steps=args.logging_steps, use_cpu=True, report_to=[],
    ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None, save_strategy="no", disable_tqdm=True,
    remove_unused_columns=False, ddp_find_unused_parameters=False, seed=args.seed, dataloader_drop_last=True,
)
trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=pad, callbacks=[Jump()])
attach(trainer, out_dir=args.out, sinks=("jsonl",), near_oom_watch=False)
trainer.train()
