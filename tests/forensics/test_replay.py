"""The allocator-history replay against real CPU runs written as CUDA history (tests/anatomy_recorder.py):
its peak against the recorder's own count, its categories against PyTorch's MemTracker, the traces a
real ring gives (wrapped, two streams, an OOM), and the logits of an 8B model under FakeTensorMode."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankmem.engine.model import GPT, GPTConfig
from rankmem.forensics.replay import CATEGORIES, replay
from rankmem.forensics.sampler import ModuleTags, addresses
from tests.anatomy_recorder import Recorder

VOCAB = 2048


class WithLoss(nn.Module):
    """The reference GPT with its loss inside the root module: every forward allocation is a module's."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=128, n_layer=2, n_head=4, n_embd=128))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.gpt(idx).view(-1, VOCAB), idx.view(-1))


def _job() -> tuple[WithLoss, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, VOCAB, (4, 128))
    model(idx).backward()
    opt.step()  # the optimizer state exists from here
    opt.zero_grad(set_to_none=True)
    return model, opt, idx


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _bytes(rec: Recorder, tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages, as the recorder holds them (512-byte blocks)."""
    return sum(rec.blocks[rec.by_storage[id(t.untyped_storage())]]["size"]
               for t in {id(t.untyped_storage()): t for t in tensors}.values())


def _window(rec: Recorder, model: nn.Module, body: Any) -> tuple[list[Any], dict[str, Any], int]:
    """Open a window (peak reset, baseline with its mark, module tags), run ``body``, close it."""
    tags = ModuleTags(rec.set_metadata, lambda: "update")
    tags.name(model)
    with rec:
        rec.reset_peak()
        opened = rec.allocated
        tags.install()
        baseline = rec.segments()
        try:
            body()
        finally:
            tags.remove()
        return baseline, rec.snapshot(), opened


def test_the_replays_peak_is_the_recorders_to_the_byte_and_its_categories_sum_to_it() -> None:
    model, opt, idx = _job()
    rec = Recorder()
    rec.adopt(*model.parameters(), *_state(opt), idx)

    def two_micro_batches_and_a_step() -> None:
        model(idx[:2]).backward()
        model(idx[2:]).backward()  # the peak: the first micro-batch's gradients are live by now
        opt.step()

    baseline, snap, opened = _window(rec, model, two_micro_batches_and_a_step)
    owned = addresses([(model, opt)], lambda t: rec.by_storage[id(t.untyped_storage())])
    found = replay(snap, baseline, owned)
    assert found["peak_bytes"] == rec.peak and found["baseline_bytes"] == opened
    cats = found["categories"]
    assert list(cats) == list(CATEGORIES) and sum(cats.values()) == rec.peak
    assert cats["parameters"] == _bytes(rec, list(model.parameters()))  # the tied head counted once
    assert cats["optimizer"] == _bytes(rec, [v for v in _state(opt) if v.ndim >= 1])
    assert cats["gradients"] == _bytes(rec, [p.grad for p in model.parameters() if p.grad is not None])
    assert cats["activations"] > 0 and cats["temporaries"] > 0
    assert (found["instant"], found["wrapped"], found["unmatched_frees"]) == ("peak", False, 0)
    assert found["tag"].startswith("update|")
    sizes = [h[2] for h in found["top"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 8
    acts = [h for h in found["top"] if h[0] == "activations"]
    names = {n or "WithLoss" for n, _ in model.named_modules()}
    assert acts and {h[1] for h in acts} <= names  # by module, from the forward hooks' tags
    assert len(json.dumps(found)) < 1500  # about 1 KB in the run log


def test_categories_match_memtracker_at_the_peak_within_one_percent() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, idx = _job()
    rec = Recorder(granule=1)  # bytes as MemTracker counts them off CUDA
    rec.adopt(*model.parameters(), *_state(opt))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        baseline, snap, _ = _window(rec, model, lambda: model(idx).backward())
        (truth,) = tracker.get_tracker_snapshot("peak").values()
    owned = addresses([(model, opt)], lambda t: rec.by_storage[id(t.untyped_storage())])
    cats = replay(snap, baseline, owned)["categories"]
    want = {k.value if hasattr(k, "value") else k: v for k, v in truth.items()}
    pairs = [(cats["parameters"], want["Parameter"]), (cats["optimizer"], want["Optstate"]),
             (cats["activations"], want["Activation"]),
             (cats["gradients"] + cats["temporaries"], want["Gradient"] + want["Temp"]),
             (sum(cats.values()), want["Total"])]
    for ours, theirs in pairs:
        assert theirs > 0 and abs(ours - theirs) <= 0.01 * theirs, (cats, want)


def _grow(rec: Recorder, n: int) -> list[torch.Tensor]:
    kept = [torch.ones(1024) for _ in range(n)]
    for _ in range(n):
        torch.zeros(1024)  # born and freed: entries that push the window's start off the ring
    return kept


def test_a_ring_that_wrapped_past_the_window_start_still_gives_the_late_peak() -> None:
    rec = Recorder(max_entries=200)
    old = [torch.ones(1024) for _ in range(10)]
    rec.adopt(*old)
    with rec:
        rec.reset_peak()
        baseline = rec.segments()
        kept = _grow(rec, 100)
        del old[:5]  # frees of blocks allocated before the ring's first entry kept
        del kept[:50]
        big = torch.ones(1 << 20)  # the peak, late in the window: inside the ring
        snap = rec.snapshot()
    found = replay(snap, baseline)
    assert found["wrapped"] and found["entries"] == 200
    cats = found["categories"]
    assert found["peak_bytes"] == rec.peak == cats["temporaries"] + cats["pre_window"]
    assert found["unmatched_frees"] == 5 + 50  # counted, not a crash
    assert found["top"][0][0::2] == ["temporaries", 4 << 20] and "test_a_ring" in found["top"][0][1]
    del big


def test_a_free_of_a_block_never_seen_is_counted() -> None:
    trace = [{"action": "snapshot", "addr": 0, "size": 0}, {"action": "alloc", "addr": 4096, "size": 512},
             {"action": "free_requested", "addr": 8192, "size": 512},
             {"action": "free_completed", "addr": 8192}]
    found = replay({"segments": [], "device_traces": [trace]}, baseline=[])
    assert (found["peak_bytes"], found["unmatched_frees"], found["wrapped"]) == (512, 1, False)


def test_blocks_from_before_the_window_and_a_second_stream() -> None:
    rec = Recorder()
    with rec:
        cache = torch.ones(256, 1024)  # allocated while recording, before the window: its frames are known
        rec.reset_peak()
        baseline = rec.segments()
        rec.stream = 7
        side = torch.ones(512, 1024)  # used on a side stream: its free completes only when the stream syncs
        rec.stream = 0
        del side
        after = torch.ones(128, 1024)  # while the side block awaits its event
        rec.sync()
        snap = rec.snapshot()
    found = replay(snap, baseline)
    trace = snap["device_traces"][0]
    assert found["peak_bytes"] == rec.peak == 4 * (256 + 512) * 1024  # allocated drops at free_requested
    assert [h[0] for h in found["top"]] == ["temporaries", "pre_window"]
    (pre,) = [h for h in found["top"] if h[0] == "pre_window"]
    assert pre[2] == 1 << 20 and pre[1].startswith("test_blocks_from_before_the_window_and_a_second_stream@")
    assert {e["stream"] for e in trace if e["action"] == "alloc"} == {0, 7}
    actions = [(e["action"], e["stream"]) for e in trace]
    requested, completed = actions.index(("free_requested", 7)), actions.index(("free_completed", 7))
    assert ("alloc", 0) in actions[requested:completed]  # 'after' came while the side block awaited its event
    del cache, after


def test_an_oom_in_the_window_is_the_instant_and_the_process_goes_on() -> None:
    rec = Recorder(limit=36 << 20)
    with rec:
        rec.reset_peak()
        baseline = rec.segments()
        held = torch.ones(6 << 20)  # 24 MiB
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(4 << 20)  # 16 MiB more, past the 36 allowed
        del held
        after = torch.ones(1 << 20)  # the process goes on
        snap = rec.snapshot()
    found = replay(snap, baseline)
    assert found["instant"] == "oom" and found["requested_bytes"] == 16 << 20
    assert found["peak_bytes"] == 24 << 20 and found["top"][0][2] == 24 << 20
    assert "test_an_oom_in_the_window" in found["top"][0][1]
    del after


class _Layer(nn.Module):
    def __init__(self, d: int, ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up, self.down = (nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False),
                                         nn.Linear(ff, d, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[1], x.shape[2]
        q, k, v = (z.view(1, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(1, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _Llama8B(nn.Module):
    """Llama-3-8B's shapes (32 layers, width 4096, MLP 14336) with a 151,936-token vocabulary, in bf16."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 4096)
        self.layers = nn.ModuleList(_Layer(4096, 14336, 32) for _ in range(32))
        self.norm = nn.RMSNorm(4096)
        self.lm_head = nn.Linear(4096, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.lm_head(self.norm(x))
        return out


def log_prob(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """verl's shape of it: the logits upcast, their log-softmax, the taken tokens' entries."""
    logits = model(idx).float()
    logp = logits.log_softmax(-1)
    return torch.gather(logp, -1, idx.unsqueeze(-1))


def test_the_top_temporary_in_log_prob_of_an_8b_model_is_the_logits() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    vocab, tokens = 151_936, 8192
    fake = FakeTensorMode()  # sizes without memory: 16 GB of weights and 10 GB of logits on no device
    torch.set_default_dtype(torch.bfloat16)
    try:
        with fake:
            model = _Llama8B(vocab)
    finally:
        torch.set_default_dtype(torch.float32)
    with fake:
        idx = torch.randint(0, vocab, (1, tokens))
        rec = Recorder()
        rec.adopt(*model.parameters(), idx)
        with torch.no_grad():
            baseline, snap, _ = _window(rec, model, lambda: log_prob(model, idx))
    owned = addresses([(model, None)], lambda t: rec.by_storage[id(t.untyped_storage())])
    found = replay(snap, baseline, owned)
    assert found["peak_bytes"] == rec.peak
    assert found["categories"]["parameters"] == sum(p.numel() * 2 for p in model.parameters())  # 8.0B params
    assert found["categories"]["activations"] == 0  # no_grad: nothing is kept for a backward
    temp = [h for h in found["top"] if h[0] == "temporaries"]
    logits = tokens * vocab * 4
    assert abs(temp[0][2] - logits) <= 0.05 * logits and temp[0][1].startswith("log_prob@test_replay.py:")
