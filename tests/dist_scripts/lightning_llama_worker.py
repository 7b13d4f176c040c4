"""A Lightning job on a tiny random Llama (transformers' model, no download), padded batches of mappings,
rankmem's callback alone.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_scripts/lightning_llama_worker.py OUT \
        [--steps 30] [--accum 1]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from rankmem.engine.hostheap import release_freed_heap
from rankmem.integrations.lightning import RankmemCallback

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--accum", type=int, default=1)
args = parser.parse_args()

torch.manual_seed(0)
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
rng = np.random.default_rng(rank)
data = [torch.randint(3, 2048, (int(n),)) for n in rng.integers(16, 129, size=args.steps * args.accum * 4)]


def pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 2, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Llama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM._from_config(LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=1,
            pad_token_id=2),
            attn_implementation="sdpa")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        release_freed_heap()  # docs/advice.md: each window's host peak its own

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# Each rank its own data (no distributed sampler): the ranks still run the same number of batches.
loader = DataLoader(data, batch_size=4, collate_fn=pad)
trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                    max_steps=args.steps,
                    accumulate_grad_batches=args.accum, use_distributed_sampler=False, logger=False,
                    callbacks=[RankmemCallback(out_dir=args.out, sinks=("jsonl",), near_oom_watch=False)],
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Llama(), loader)
