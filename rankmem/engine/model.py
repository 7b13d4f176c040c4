"""A tiny GPT (decoder-only transformer) for the reference worker: small enough to train on CPU.

The shape follows the usual GPT-2 layout (pre-norm blocks, causal self-attention, a 4x MLP, tied
input and output embeddings), sized by :class:`GPTConfig` to a few hundred thousand parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rankmem.errors import RankmemError


@dataclass
class GPTConfig:
    """Size of the model. The defaults give about 0.35M parameters."""

    vocab_size: int = 32
    """Number of token ids; the generated tasks use small vocabularies."""
    block_size: int = 32
    """Longest sequence the position embedding covers."""
    n_layer: int = 3
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 96
    """Width of the residual stream; must be divisible by ``n_head``."""
    attention: str = "sdpa"
    """``sdpa`` (fused: memory linear in tokens) or ``materialized`` (scores as tensors: quadratic)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise RankmemError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise RankmemError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ("sdpa", "materialized"):
            raise RankmemError(f"GPTConfig.attention must be sdpa or materialized, got {self.attention!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.materialized = cfg.attention == "materialized"
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
        if lengths is not None:
            # Packed sequences (one row, no padding): attention within each sequence, as varlen attention
            # kernels do; the rest of the block runs on all tokens at once.
            parts = [self._attend(chunk) for chunk in torch.split(x, list(lengths), dim=1)]
            out: torch.Tensor = self.proj(torch.cat(parts, dim=1))
            return out
        out = self.proj(self._attend(x))
        return out

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.materialized:
            # The textbook form: (B, H, T, T) scores, their softmax and the mask live as tensors.
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y: torch.Tensor = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, c)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd,
                                                                                             cfg.n_embd))

    def forward(self, x: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), lengths)
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """``forward(idx) -> logits`` of shape ``(batch, time, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
        """``idx`` (B, T); or, with ``lengths``, one row (1, sum(lengths)) of sequences packed end to end."""
        t = max(lengths) if lengths is not None else idx.shape[1]
        if t > self.cfg.block_size:
            raise RankmemError(f"sequence of {t} tokens exceeds block_size {self.cfg.block_size}: raise "
                               "GPTConfig.block_size")
        if lengths is None:
            pos = torch.arange(t, device=idx.device)
        else:
            pos = torch.cat([torch.arange(n, device=idx.device) for n in lengths])
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x, lengths)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6N for the weights plus attention's
        12 * layers * width * seq_len (PaLM, appendix B)."""
        c = self.cfg
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_embd * seq_len
