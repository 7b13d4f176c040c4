"""``TrainingWorker``: the reference engine worker, in the shape of verl's.

``train_batch`` runs micro-batches with gradient accumulation, clips gradients and steps the optimizer
and LR scheduler; ``infer_batch`` is forward only; ``_postprocess_output`` builds the step's metrics and
gathers them with the memory metrics in the single collective of :meth:`rankmem.Monitor.collect`, after
the step window has closed (:meth:`finish_step`), so the step's peak covers rollout, log-prob and
update. Without a monitor the same scalars travel by :func:`rankmem.allgather_dict_into_dict`: the
overhead benchmark's baseline. The engine is DDP or FSDP2 over gloo or NCCL; each micro-batch's summed
loss is scaled by ``world_size / global_tokens`` so the gradient is that of the global token mean.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rankmem.engine.data import Batch
from rankmem.engine.hostheap import release_freed_heap
from rankmem.engine.model import GPT
from rankmem.engine.options import ENGINES
from rankmem.engine.packing import pack
from rankmem.errors import RankmemError
from rankmem.exchange.aggregate import aggregate
from rankmem.exchange.dict_gather import allgather_dict_into_dict
from rankmem.monitor import Monitor


@dataclass
class MicroBatch:
    """Rows of the batch on the device: padded rows, or (with ``lengths``) one row of them packed."""

    rows: list[int]
    batch: Batch
    lengths: list[int] | None = None

    def work(self) -> tuple[int, int, int]:
        """(tokens, sequences, sum of squared sequence lengths) the model computes on."""
        if self.lengths is None:
            n, t = self.batch["input_ids"].shape
            return n * t, n, n * t * t
        return sum(self.lengths), len(self.lengths), sum(n * n for n in self.lengths)


LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""``loss_fn(log_probs, micro_batch) -> summed loss`` over the masked tokens (a sum, not a mean: the
worker does the global token scaling)."""


@dataclass
class WorkerConfig:
    """Optimisation and engine settings of a :class:`TrainingWorker`."""

    engine: str = "ddp"
    """``ddp`` (DistributedDataParallel) or ``fsdp`` (FSDP2, ``fully_shard`` per block and the root)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Linear warmup steps before the cosine decay."""
    total_steps: int = 100
    """Length of the cosine schedule; the LR ends at ``min_lr_ratio * lr``."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    micro_batch_size: int = 16
    """Rows per forward/backward; a larger batch is accumulated over micro-batches."""
    max_token_len: int | None = None
    """For batches with ``lengths``: tokens per micro-batch of :meth:`TrainingWorker.train_batch`, packed
    without padding (verl's ``ppo_max_token_len_per_gpu``, a target: see :mod:`rankmem.engine.packing`)."""
    log_prob_max_token_len: int | None = None
    """The same for :meth:`TrainingWorker.infer_batch` (verl's ``log_prob_max_token_len_per_gpu``)."""
    release_heap: bool = False
    """After each packed step on the CPU, hand glibc's freed heap back (:mod:`rankmem.engine.hostheap`), so
    that a step's host peak is its own and not what a larger micro-batch before it left resident."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for the MFU estimate; default 989 on CUDA (H100 bf16) and
    0.1 on CPU (roughly two cores' fp32 FMA peak)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise RankmemError(f"unknown engine {self.engine!r}: choose from {', '.join(ENGINES)}")
        if self.micro_batch_size < 1:
            raise RankmemError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise RankmemError("total_steps must be >= 1 and warmup_steps >= 0")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise RankmemError(f"peak_tflops must be > 0, got {self.peak_tflops}")


@dataclass
class TrainOutput:
    """One rank's unreduced figures from :meth:`TrainingWorker.train_batch`."""

    loss_sum: float
    """Summed (unscaled) loss over this rank's masked tokens."""
    local_tokens: float
    """This rank's masked (loss) tokens."""
    global_tokens: float
    """Masked tokens over all ranks (one all_reduce SUM per step)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""
    tokens: int
    """Tokens this rank pushed through forward and backward (for throughput and MFU)."""
    seconds: float
    """Wall time of ``train_batch`` on this rank."""


@dataclass
class InferOutput:
    """Forward-only results of :meth:`TrainingWorker.infer_batch`."""

    log_probs: torch.Tensor
    """(B, T - 1) log-probability of each next token."""
    loss_sum: float | None = None
    """Summed loss over the masked tokens, when a loss function was given."""


def sft_loss(log_probs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy, summed over the masked tokens."""
    return -(log_probs * batch["loss_mask"]).sum()


def make_pg_loss(clip_eps: float = 0.2) -> LossFn:
    """The PPO-clip policy-gradient loss on per-sequence advantages (GRPO), summed over response tokens."""

    def pg_loss(log_probs: torch.Tensor, batch: Batch) -> torch.Tensor:
        ratio = torch.exp(log_probs - batch["old_log_probs"])
        adv = batch["advantages"]
        adv = adv[:, None] if adv.dim() == 1 else adv  # per sequence, or per token of a packed row
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        return -(surrogate * batch["loss_mask"]).sum()

    return pg_loss


def _lr_lambda(cfg: WorkerConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def wrap_model(model: GPT, engine: str, device: torch.device) -> nn.Module:
    """Wrap ``model`` (already on ``device``) in the data-parallel engine. Needs an initialised group."""
    if not dist.is_initialized():
        raise RankmemError("the engine needs torch.distributed: launch with torchrun (see rankmem.engine.train)")
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:
        raise RankmemError(
            f"--engine fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); this torch "
            f"{torch.__version__} lacks it: upgrade torch or use --engine ddp"
        ) from exc
    try:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    except (RuntimeError, NotImplementedError) as exc:
        backend = dist.get_backend()
        raise RankmemError(
            f"FSDP2 cannot shard on {device.type} with the {backend} backend in torch {torch.__version__} "
            f"({exc}): use --engine ddp"
        ) from exc
    return model


class TrainingWorker:
    """A data-parallel GPT worker. Build it on every rank; :meth:`train_batch` and :meth:`finish_step`
    are collectives (every rank calls them on the same steps)."""

    def __init__(
        self,
        model: GPT,
        config: WorkerConfig,
        *,
        device: torch.device,
        monitor: Monitor | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.monitor = monitor
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # Before sharding: FSDP2 leaves each rank only its shard of the parameters.
        self.flops_per_token = model.flops_per_token(model.cfg.block_size)
        self.model = model
        self.module = wrap_model(model.to(device), config.engine, device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config))
        if monitor is not None:  # after wrap_model: FSDP2 has replaced the parameters by their shards
            monitor.track(self.module, self.optimizer)
        peak = config.peak_tflops if config.peak_tflops is not None else (989.0 if device.type == "cuda" else 0.1)
        self.peak_flops = peak * 1e12
        self._in_phase = 0

    # ---- telemetry windows (no-ops without a monitor) -----------------------------------------------
    def step(self, n: int) -> contextlib.AbstractContextManager[None]:
        return self.monitor.step(n) if self.monitor is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.monitor is None:
            yield
            return
        self._in_phase += 1  # micro-batches are told to the monitor inside phases only
        try:
            with self.monitor.phase(name):
                yield
        finally:
            self._in_phase -= 1

    def _tell(self, mb: MicroBatch) -> None:
        if self.monitor is not None and self._in_phase:
            tokens, sequences, sq_tokens = mb.work()
            self.monitor.micro_batch(tokens, sequences=sequences, sq_tokens=sq_tokens)

    # ---- compute -------------------------------------------------------------------------------------
    def _log_probs(self, input_ids: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """(B, T - 1) log-probability of each next token; packed: (1, T - sequences), each sequence's own."""
        if lengths is None:
            logits = self.module(input_ids)[:, :-1].float()
            return torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:, None]).squeeze(2)
        logits = self.module(input_ids, lengths)[0, :-1].float()
        lp = torch.gather(F.log_softmax(logits, dim=-1), 1, input_ids[0, 1:, None]).squeeze(1)
        keep = torch.ones(lp.shape[0], dtype=torch.bool, device=lp.device)
        keep[torch.tensor(lengths[:-1]).cumsum(0) - 1] = False  # a sequence's last token predicts the next's first
        return lp[keep][None]

    @contextlib.contextmanager
    def _grad_sync(self, enabled: bool) -> Iterator[None]:
        """Reduce gradients only on the last micro-batch: one all-reduce per step, not per micro-batch."""
        if self.config.engine == "ddp":
            with contextlib.nullcontext() if enabled else self.module.no_sync():  # type: ignore[operator]
                yield
        else:
            self.module.set_requires_gradient_sync(enabled)  # type: ignore[operator]
            yield

    def _release_heap(self, batch: Batch) -> None:
        # Called by train_batch / infer_batch after the step's own frame has returned: trimmed inside it, the
        # micro-batches, the autograd nodes and the loss it still held were freed into the heap only after the
        # trim, and stayed resident between steps in proportion to the step's tokens (bench/RESULTS.md: 4 to
        # 13 MiB, growing with the budget, on the advice bench's materialised model).
        if self.config.release_heap and "lengths" in batch and self.device.type == "cpu":
            release_freed_heap()

    def _micro_batches(self, batch: Batch, budget: int | None) -> list[MicroBatch]:
        """``micro_batch_size`` padded rows each; with ``lengths`` in the batch and a token ``budget``,
        verl's balanced token-budget packing, each micro-batch one row of its sequences end to end."""
        n = batch["input_ids"].shape[0]
        if "lengths" not in batch or budget is None:
            mbs = self.config.micro_batch_size
            return [MicroBatch(list(range(i, min(i + mbs, n))),
                               {k: v[i : i + mbs].to(self.device) for k, v in batch.items() if k != "lengths"})
                    for i in range(0, n, mbs)]
        lengths = batch["lengths"].tolist()
        return [self._packed(batch, rows, [lengths[r] for r in rows]) for rows in pack(lengths, budget)]

    def _packed(self, batch: Batch, rows: list[int], lengths: list[int]) -> MicroBatch:
        full = batch["input_ids"].shape[1]
        fields: Batch = {}
        for k, v in batch.items():
            if k == "lengths":
                continue
            if v.dim() == 1:  # per sequence: repeated over its predicted tokens
                fields[k] = torch.cat([v[r].repeat(n - 1) for r, n in zip(rows, lengths, strict=True)])[None]
            else:  # per position (T) or per predicted position (T - 1)
                short = full - v.shape[1]
                fields[k] = torch.cat([v[r, : n - short] for r, n in zip(rows, lengths, strict=True)])[None]
        return MicroBatch(rows, {k: v.to(self.device) for k, v in fields.items()}, lengths)

    def train_batch(self, batch: Batch, loss_fn: LossFn = sft_loss) -> TrainOutput:
        """One optimizer step on ``batch``. A collective (token count, gradient reduction)."""
        out = self._train_batch(batch, loss_fn)
        self._release_heap(batch)
        return out

    def _train_batch(self, batch: Batch, loss_fn: LossFn) -> TrainOutput:
        t0 = time.perf_counter()
        self.module.train()
        local_tokens = batch["loss_mask"].sum().to(self.device, torch.float64)
        global_tokens_t = local_tokens.clone()
        dist.all_reduce(global_tokens_t, op=dist.ReduceOp.SUM)  # gloo has SUM (not AVG)
        global_tokens = float(global_tokens_t.item())
        if global_tokens <= 0:
            raise RankmemError("the global batch has no loss tokens: check loss_mask")
        scale = self.world_size / global_tokens
        micro = self._micro_batches(batch, self.config.max_token_len)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, mb in enumerate(micro):
            self._tell(mb)
            with self._grad_sync(i == len(micro) - 1):
                summed = loss_fn(self._log_probs(mb.batch["input_ids"], mb.lengths), mb.batch)
                (summed * scale).backward()  # type: ignore[no-untyped-call]
            loss_sum += summed.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        full = getattr(norm, "full_tensor", None)  # FSDP2 returns a DTensor
        grad_norm = float((full() if full is not None else norm).item())  # a device sync point
        lr = float(self.scheduler.get_last_lr()[0])
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        tokens = int(batch["lengths"].sum()) if "lengths" in batch else int(batch["input_ids"].numel())
        return TrainOutput(
            loss_sum=float(loss_sum.item()),
            local_tokens=float(local_tokens.item()),
            global_tokens=global_tokens,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            seconds=time.perf_counter() - t0,
        )

    def infer_batch(self, batch: Batch, loss_fn: LossFn | None = None) -> InferOutput:
        """Forward only: per-token log-probs (on the CPU), and the summed loss when ``loss_fn`` is given."""
        out = self._infer_batch(batch, loss_fn)
        self._release_heap(batch)
        return out

    @torch.no_grad()
    def _infer_batch(self, batch: Batch, loss_fn: LossFn | None) -> InferOutput:
        self.module.eval()
        ids = batch["input_ids"]
        out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        loss_sum = 0.0
        for mb in self._micro_batches(batch, self.config.log_prob_max_token_len):
            self._tell(mb)
            lp = self._log_probs(mb.batch["input_ids"], mb.lengths)
            if loss_fn is not None:
                loss_sum += float(loss_fn(lp, mb.batch).item())
            if mb.lengths is None:
                out[mb.rows] = lp.cpu()
            else:
                for r, piece in zip(mb.rows, torch.split(lp[0].cpu(), [n - 1 for n in mb.lengths]), strict=True):
                    out[r, : piece.shape[0]] = piece
        return InferOutput(out, loss_sum if loss_fn is not None else None)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Sample ``new_tokens`` after each prompt from the policy. Every rank must call it with the same
        shapes (FSDP2 all-gathers parameters in each forward)."""
        self.module.eval()
        seq = prompts.to(self.device)
        for _ in range(new_tokens):
            logits = self.module(seq)[:, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
            seq = torch.cat([seq, nxt], dim=1)
        return seq.cpu()

    # ---- metrics ---------------------------------------------------------------------------------------
    def _postprocess_output(self, out: TrainOutput, extra: Mapping[str, float]) -> dict[str, float]:
        """The step's metrics, aggregated over ranks in one collective (memory keys included when a
        monitor is attached). Returns ``K/max``, ``K/min``, ``K/mean``, ``K/max_rank`` per key.

        ``loss``: this rank's summed loss times ``world / global_tokens``, so ``loss/mean`` is the exact token
        mean over the global batch. ``throughput/tokens_per_s`` and ``mfu`` are per rank (the job's:
        ``mean * world``).
        """
        tokens_per_s = out.tokens / out.seconds if out.seconds > 0 else float("nan")
        local: dict[str, float] = {
            "loss": out.loss_sum * self.world_size / out.global_tokens,
            "grad_norm": out.grad_norm,
            "lr": out.lr,
            "throughput/tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / self.peak_flops,
            "step_time_s": out.seconds,
            **extra,
        }
        if self.monitor is not None:
            return self.monitor.collect(local)
        gathered = allgather_dict_into_dict(local)
        keys = list(gathered)
        # Every rank sends the same keys, so a NaN is a rank's own value (a diverged loss): it propagates.
        return aggregate(keys, np.array([gathered[k] for k in keys], dtype=np.float64).T)

    def finish_step(self, out: TrainOutput, extra: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Gather the step's metrics (a collective): call it on every rank after the step window closes."""
        return self._postprocess_output(out, {k: float(v) for k, v in (extra or {}).items()})
