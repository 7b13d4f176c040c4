"""The sampled replay against the device: what held a window's peak, checked on the reference GPT.

Run:  python scripts/gpu_anatomy_check.py            # on a CUDA device (scripts/gpu_check.sh's anatomy step)
      python scripts/gpu_anatomy_check.py --dry-run  # anywhere: checks the arguments, exits

On a GPT of the reference shape (``--layers``, width 1024, a 151,936-token vocabulary, bf16, AdamW) and
one micro-batch of ``--tokens`` tokens:

1. exact: a sampled update step's replay (``baseline + rise``) equals ``max_memory_allocated`` to the
   byte, its categories sum to it, and its parameter and optimizer blocks hold the bytes of the tensors;
2. classes: in a sampled log_prob window (no_grad) the top temporary is the fp32 logits, within 5% of
   ``T x V x 4`` B; where ``_set_memory_metadata`` exists, activations of the update carry module names;
3. cost: a sampled step (recording, the snapshot at close) costs at most ``--max-cost`` x an unsampled
   one, and 10 history on/off cycles leave a 1 MiB allocation's time within 5%;
4. OOM: an allocation of twice the device inside a sampled step of a Monitor is replayed (the instant
   is the ``oom`` entry, the block held is named) and the next step runs.

One ``FAIL`` line per miss, exit 1; every figure is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from typing import Any

VOCAB = 151_936


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the micro-batch (default 4096)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--max-cost", type=float, default=1.3,
                   help="sampled over unsampled step time (default 1.3)")
    p.add_argument("--dry-run", action="store_true", help="check the arguments and exit")
    args = p.parse_args(argv)
    if args.tokens < 16 or args.layers < 1 or args.max_cost <= 1:
        p.error("--tokens >= 16, --layers >= 1 and --max-cost > 1, please")
    return args


def judge_exact(found: dict[str, Any], max_allocated: int, params: int, state: int) -> list[str]:
    """The misses of check 1 (pure: a CPU test runs it on made-up figures)."""
    fails = []
    rise = found["peak_bytes"] - found["baseline_bytes"]
    if found["baseline_bytes"] + rise != max_allocated:
        fails.append(f"baseline + rise {found['baseline_bytes']} + {rise} B != max_memory_allocated "
                     f"{max_allocated} B")
    summed = sum(found["categories"].values())
    if summed != found["peak_bytes"]:
        fails.append(f"categories sum to {summed} B, not the peak {found['peak_bytes']} B")
    for name, want in (("parameters", params), ("optimizer", state)):
        got = found["categories"][name]
        if not want <= got <= want * 1.01:  # blocks: the request rounded up to 512 B, at most a split's rest
            fails.append(f"{name} by address {got} B, the tensors hold {want} B")
    if found["wrapped"] or found["unmatched_frees"]:
        fails.append(f"the ring lost the window's start (wrapped {found['wrapped']}, "
                     f"{found['unmatched_frees']} unmatched frees): raise the entries")
    return fails


def judge_logits(found: dict[str, Any], tokens: int, vocab: int = VOCAB) -> list[str]:
    temps = [h for h in found["top"] if h[0] == "temporaries"]
    want = tokens * vocab * 4
    if not temps or abs(temps[0][2] - want) > 0.05 * want:
        return [f"top temporary {temps[:1]} is not the fp32 logits, {want} B within 5%"]
    return []


def _model(layers: int, tokens: int) -> tuple[Any, Any]:
    import torch

    from rankmem.engine.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=tokens, n_layer=layers, n_head=8, n_embd=1024))
    model = model.to(device="cuda", dtype=torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def log_prob(model: Any, idx: Any) -> Any:
    logits = model(idx).float()
    logp = logits.log_softmax(-1)
    return logp.gather(-1, idx.unsqueeze(-1))


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.dry_run:
        print(f"gpu_anatomy_check: dry run: {args.layers} layers, {args.tokens} tokens, "
              f"max cost {args.max_cost}")
        return 0
    import torch

    import rankmem
    from rankmem.forensics.sampler import HistorySampler
    from rankmem.offline.events import read_events
    from rankmem.probe.device import select_backend
    from rankmem.windows import Where

    model, opt = _model(args.layers, args.tokens)
    idx = torch.randint(0, VOCAB, (1, args.tokens), device="cuda")

    def update() -> None:
        torch.nn.functional.cross_entropy(model(idx).view(-1, VOCAB).float(), idx.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    update()  # the optimizer state exists from here
    backend = select_backend("cuda")
    assert backend is not None
    events: list[Any] = []
    phase = ["update"]
    anatomy = HistorySampler(backend, events.append, lambda: Where(0, phase[0]), entries=100_000)
    anatomy.track(model, opt)
    fails: list[str] = []

    def sampled(body: Any) -> tuple[dict[str, Any], float]:
        anatomy.request()
        start = time.perf_counter()
        with anatomy.step(contextlib.nullcontext()):
            body()
        spent = time.perf_counter() - start
        anatomy.close()  # waits for the replay
        return events[-1].extra, spent

    # 1. exact
    torch.cuda.reset_peak_memory_stats()
    found, _ = sampled(update)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())  # the tied head is one Parameter
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if v.ndim >= 1)
    fails += judge_exact(found, torch.cuda.max_memory_allocated(), params, state)
    print("update window:", json.dumps(found))
    acts = [h for h in found["top"] if h[0] == "activations"]
    if hasattr(torch.cuda.memory, "_set_memory_metadata") and not acts:
        fails.append("no activation holder carries a module name: _set_memory_metadata's tags are missing")

    # 2. classes
    phase[0] = "log_prob"
    with torch.no_grad():
        found, _ = sampled(lambda: (log_prob(model, idx), torch.cuda.synchronize()))
    print("log_prob window:", json.dumps(found))
    fails += judge_logits(found, args.tokens)
    phase[0] = "update"

    # 3. cost
    plain = []
    for _ in range(5):
        start = time.perf_counter()
        update()
        plain.append(time.perf_counter() - start)
    costs = [sampled(update)[1] for _ in range(3)]
    ratio = statistics.median(costs) / statistics.median(plain)
    print(f"step {statistics.median(plain) * 1e3:.1f} ms unsampled, {statistics.median(costs) * 1e3:.1f} ms "
          f"sampled ({ratio:.2f}x; {found['entries']} entries in the log_prob window)")
    if ratio > args.max_cost:
        fails.append(f"a sampled step costs {ratio:.2f}x an unsampled one (at most {args.max_cost}x)")

    def alloc_us() -> float:
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            best.append((time.perf_counter() - start) / 2000 * 1e6)
        return min(best)

    before = alloc_us()
    for _ in range(10):
        backend.record_history(100_000, clear=True)
        backend.record_history(0)
    after = alloc_us()
    print(f"1 MiB allocation {before:.2f} us, after 10 history on/off cycles {after:.2f} us")
    if after > before * 1.05:
        fails.append(f"10 history on/off cycles slowed allocation {after / before:.3f}x (pytorch#153571)")

    # 4. OOM, through the Monitor
    with tempfile.TemporaryDirectory() as out:
        monitor = rankmem.Monitor(out_dir=out, device="cuda", children=False, near_oom_watch=False,
                                  anatomy_every=1)
        total = torch.cuda.mem_get_info()[1]
        with contextlib.suppress(torch.OutOfMemoryError), monitor.step(0), monitor.phase("update"):
            held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        del held
        with monitor.step(1):
            update()  # the process goes on
        monitor.close()
        replays = [e for e in read_events(out).events if e.kind == "anatomy" and e.step == 0]
    oom = replays[0].extra if replays else {}
    print("OOM window:", json.dumps(oom))
    named = [h for h in oom.get("top", []) if "main@gpu_anatomy_check.py" in h[1]]  # the model: pre_window
    if oom.get("instant") != "oom" or not named or named[0][2] != 1 << 30:
        fails.append("the OOM's replay does not name the 1 GiB block held at the failure")

    for line in fails:
        print("FAIL", line)
    print(f"gpu_anatomy_check: {'ok' if not fails else f'{len(fails)} failed'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
