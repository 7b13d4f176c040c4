"""The advice against the device: probe the reference GPT at 2k-16k tokens per micro-batch, then check
what ``rankmem advise`` predicts at 24k and 32k against what those micro-batches really take.

Run:  python scripts/gpu_advise_check.py --out /tmp/advise_check      # on a CUDA device (scripts/gpu_check.sh)
      python scripts/gpu_advise_check.py --dry-run                    # anywhere: checks the arguments, exits

For each attention (``sdpa``: memory linear in tokens; ``materialized``: the (T, T) scores as tensors,
quadratic) a Monitor records one ``update`` phase per probe step (forward and backward of one sequence
of T tokens, told as ``micro_batch(T, 1, T*T)``) into ``OUT/<attention>``; ``rankmem advise
--at-tokens`` predicts the peak at each check T (past 1.5x the largest probe advise declines, as it
should, and the fit it declines with is read directly). The same micro-batch is then run, and the
prediction, which advise sets against capacity, is compared with ``torch.cuda.max_memory_reserved``
plus the device's used memory outside the allocator (``torch.cuda.mem_get_info``). A prediction more
than ``--tolerance`` off, or a measurement over the interval's high end by more than that, is a miss:
one ``MISS`` line each, exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ATTENTIONS = ("sdpa", "materialized")
PHASE = "update"
WARMUP = 2
GIB = 2**30


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="run directories go under OUT/<attention> (default: a temp dir)")
    p.add_argument("--probe-tokens", default="2048,4096,6144,8192,12288,16384", metavar="T,...",
                   help="tokens per micro-batch of the probe steps (default 2048..16384)")
    p.add_argument("--check-tokens", default="24576,32768", metavar="T,...",
                   help="tokens per micro-batch whose prediction is checked (default 24576,32768)")
    p.add_argument("--repeats", type=int, default=2, help="probe steps per probe T (default 2)")
    p.add_argument("--attention", default=",".join(ATTENTIONS), help="sdpa, materialized or both (default both)")
    p.add_argument("--tolerance", type=float, default=0.15,
                   help="the largest relative error of a prediction that is not a miss (default 0.15)")
    p.add_argument("--dry-run", action="store_true", help="check the arguments and exit")
    args = p.parse_args(argv)
    try:
        args.probe = [int(t) for t in args.probe_tokens.split(",")]
        args.check = [int(t) for t in args.check_tokens.split(",")]
    except ValueError:
        p.error("--probe-tokens and --check-tokens take comma-separated integers, e.g. 2048,4096")
    if len(set(args.probe)) < 3 or min(args.probe) < 1:
        p.error(f"--probe-tokens needs at least 3 different sizes >= 1, got {args.probe_tokens}")
    if min(args.check) < 1:
        p.error(f"--check-tokens must be >= 1, got {args.check_tokens}")
    args.attentions = args.attention.split(",")
    if not set(args.attentions) <= set(ATTENTIONS):
        p.error(f"--attention takes {' or '.join(ATTENTIONS)} (comma-separated), got {args.attention}")
    if args.repeats < 1 or (len(args.probe) * args.repeats) <= WARMUP + 3:
        p.error(f"--repeats {args.repeats} leaves too few probe steps after the {WARMUP} warm-up steps")
    if not 0 < args.tolerance < 1:
        p.error(f"--tolerance must be between 0 and 1, got {args.tolerance}")
    return args


def config(attention: str, block_size: int):  # type: ignore[no-untyped-def]
    from rankmem.engine.model import GPTConfig

    # Two heads and layers: the materialized scores at 32k tokens are 8 GiB a tensor, a few per layer.
    return GPTConfig(vocab_size=256, block_size=block_size, n_layer=2, n_head=2, n_embd=256, attention=attention)


def build(attention: str, block_size: int):  # type: ignore[no-untyped-def]
    import torch

    from rankmem.engine.model import GPT

    torch.manual_seed(0)
    return GPT(config(attention, block_size)).cuda()


def step(model, tokens: int) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    idx = torch.randint(0, 256, (1, tokens), device="cuda")
    logits = model(idx)
    F.cross_entropy(logits.view(-1, logits.shape[-1]), idx.view(-1)).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()  # a sync point: the peak is reached before it is read


def probe(attention: str, args: argparse.Namespace, out: str) -> None:
    import torch

    import rankmem

    model = build(attention, max(args.probe + args.check))
    monitor = rankmem.Monitor(out_dir=out, sinks=("jsonl",), children=False, near_oom_watch=False)
    for i, t in enumerate(args.probe * args.repeats):
        # The cache emptied before each step, as verl does between phases: each window's reserved peak is
        # then its own, not the pool earlier, larger steps left (a window served from a pool of segments
        # cut for other sizes grew it by almost its whole peak: 20.5 GiB reserved for 11.0 allocated on an
        # H200, where the same step after empty_cache reserved ~12).
        torch.cuda.empty_cache()
        with monitor.step(i), monitor.phase(PHASE):
            step(model, t)
            monitor.micro_batch(t, 1, t * t)
        monitor.collect()
    monitor.close()
    del model


def predicted(out: str, t: int) -> tuple[float, float, float, str]:
    """(peak, low, high) GiB at ``t`` from ``rankmem advise --at-tokens``, or from its fit where it declines."""
    # One sequence of t tokens per micro-batch: its Q is t*t, not the probe's mean Q/T times t.
    done = subprocess.run([sys.executable, "-m", "rankmem", "advise", out, "--at-tokens", str(t), "--seq-len", str(t),
                           "--json", "--warmup", str(WARMUP)], capture_output=True, text=True, timeout=120)
    if done.returncode not in (0, 3):
        raise SystemExit(f"gpu_advise_check: rankmem advise failed (rc {done.returncode}): {done.stderr.strip()}")
    [row] = [r for r in json.loads(done.stdout) if r["phase"] == PHASE]
    if "predicted_peak_gib" in row:
        return row["predicted_peak_gib"], row["low_gib"], row["high_gib"], "advise"
    pf = fitted_phase(out)
    if not hasattr(pf.model, "predict"):
        raise SystemExit(f"gpu_advise_check: MISS {out}: no model: {row.get('reason')}")
    return (*pf.peak(t, t * t), f"its fit (advise declines: {row['reason']})")


def fitted_phase(out: str):  # type: ignore[no-untyped-def]
    """The probe's one rank's fit of the phase, as ``rankmem advise`` makes it."""
    from rankmem.offline import read_run
    from rankmem.offline.advice import fit_ranks

    [pf] = fit_ranks(read_run(out), PHASE, WARMUP)  # one rank
    return pf


def allocated_peak(out: str, t: int) -> float:
    """GiB: the fit's own peak allocated at ``t`` (one sequence), before overhead and memory outside torch."""
    pf = fitted_phase(out)
    if not hasattr(pf.model, "predict"):
        return float("nan")
    return pf.baseline + pf.model.predict(t, t * t)[0]


def measured(model, t: int) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
    """(reserved peak + other, reserved peak, other, allocated peak) GiB for one micro-batch of ``t``
    tokens, from an emptied cache as the probe's steps were."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step(model, t)
    allocated = torch.cuda.max_memory_allocated() / GIB
    peak = torch.cuda.max_memory_reserved() / GIB
    free, total = torch.cuda.mem_get_info()
    other = max((total - free) / GIB - torch.cuda.memory_reserved() / GIB, 0.0)  # context, other processes
    return peak + other, peak, other, allocated


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.dry_run:
        import rankmem.offline.advice  # noqa: F401 - import-clean where it cannot run

        for attention in args.attentions:
            config(attention, max(args.probe + args.check))
        print(f"gpu_advise_check: dry run: {args.attentions} probes {args.probe} x{args.repeats}, checks {args.check}, "
              f"tolerance {args.tolerance:g}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_advise_check: no CUDA device (torch.cuda.is_available() is false): nothing to check")
        return 2
    root = args.out or tempfile.mkdtemp(prefix="rankmem_advise_check_")
    misses = 0
    for attention in args.attentions:
        out = os.path.join(root, attention)
        probe(attention, args, out)
        torch.cuda.empty_cache()
        model = build(attention, max(args.probe + args.check))
        for t in args.check:
            peak, low, high, source = predicted(out, t)
            try:
                real, reserved, other, allocated = measured(model, t)
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                capacity = torch.cuda.mem_get_info()[1] / GIB
                miss = peak < capacity  # the prediction said it would fit
                misses += miss
                print(f"gpu_advise_check: {'MISS' if miss else 'ok'} attention={attention} T={t}: out of memory on "
                      f"this {capacity:.1f} GiB device; predicted {peak:.2f} GiB ({low:.2f}..{high:.2f}, "
                      f"from {source})")
                continue
            error = (peak - real) / real
            fitted = allocated_peak(out, t)
            miss = abs(error) > args.tolerance or real > high * (1 + args.tolerance)
            misses += miss
            print(f"gpu_advise_check: {'MISS' if miss else 'ok'} attention={attention} T={t}: predicted {peak:.2f} GiB "
                  f"({low:.2f}..{high:.2f}, from {source}), measured {real:.2f} GiB (max reserved {reserved:.2f} + "
                  f"other {other:.2f}), error {error:+.1%}; peak allocated {allocated:.2f} GiB, the fit's "
                  f"{fitted:.2f} ({(fitted - allocated) / allocated:+.1%})")
        del model
        torch.cuda.empty_cache()
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
