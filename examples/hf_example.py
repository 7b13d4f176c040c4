"""rankmem in a Hugging Face Trainer: a tiny randomly initialised GPT-2, CPU, no download.

Run:  python -m torch.distributed.run --nproc-per-node 2 examples/hf_example.py --out runs/hf
(or plain ``python examples/hf_example.py`` for one process). The Trainer's logs, and
``<out>/log_history.json``, carry the keys ``log_keys`` picks (the peak RSS and the train step's peak,
worst rank included) per log step; the run log ``<out>/rankmem.jsonl`` has every key per rank:
``rankmem report <out>``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from rankmem.integrations.hf import attach

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/hf")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
# Token ids inside the tiny vocabulary, and the loss named (transformers cannot tell it from the class
# name GPT2LMHeadModel): left at their defaults, transformers warns about each on every rank.
config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=127, eos_token_id=127)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"
ids = torch.randint(0, 128, (64, 16))
data = [{"input_ids": x, "labels": x} for x in ids]
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, logging_steps=2,
    use_cpu=True, report_to=[],
    ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # accelerate needs None in one process
    save_strategy="no", disable_tqdm=True,
    ddp_find_unused_parameters=False,  # every parameter is used: DDP need not search (and warn that it found none)
)
trainer = Trainer(model=model, args=training_args, train_dataset=data)
# Ahead of the report_to trackers; writes the run log; only these keys go to the Trainer's logs.
attach(trainer, out_dir=args.out, sinks=("jsonl",),
       log_keys=("mem/host/peak_rss_gib/*", "mem/phase/train_step/peak_rss_gib/max*"))
trainer.train()

if trainer.is_world_process_zero():
    with open(f"{args.out}/log_history.json", "w") as f:
        json.dump(trainer.state.log_history, f)
    print({k: v for k, v in trainer.state.log_history[0].items() if k.startswith("mem/")})
