"""``rankmem advise RUN``: per phase, the largest tokens per micro-batch whose predicted peak fits.

The model is fitted per phase and rank from the run's own windows (:mod:`rankmem.offline.advice`); the
advice is set against capacity minus headroom, divided by the overshoot of realised micro-batches over
the configured budget, and printed under verl's config names. ``--at-tokens T`` prints the predicted
peak per phase and rank at T instead (``--seq-len L``: in sequences of L tokens, where the quadratic
term needs it; by default the windows' own mean Q/T).

Exit status: 0 every phase has advice, 3 some phase has none (too few windows, flat or noisy: each says
why; or T past 1.5x the largest seen), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any

from rankmem.cli._common import add_run_argument, note_damage, require_steps
from rankmem.errors import RankmemError
from rankmem.fit import HEADROOM_FRACTION

if TYPE_CHECKING:
    from rankmem.fit.capacity import Limit
    from rankmem.fit.series import PhaseFit
    from rankmem.offline import Run
    from rankmem.trend.trend import Trend

NO_VERDICT = 3
EPILOG = ("exit status: 0 every phase has advice, 3 some phase has none (each says why), 2 bad input. "
          f"Headroom default: {HEADROOM_FRACTION:.0%} of the capacity.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add_run_argument(parser)
    parser.add_argument("--capacity", type=float, default=None, metavar="GIB",
                        help="memory each rank may use, GiB (default: the device total; on the host the cgroup "
                             "limit or the node's memory, shared by the ranks on the node)")
    parser.add_argument("--headroom", type=float, default=None, metavar="GIB",
                        help=f"GiB kept free below the capacity "
                             f"(default {HEADROOM_FRACTION * 100:.0f}%% of it)")
    parser.add_argument("--budget", type=int, default=None, metavar="TOKENS",
                        help="the token budget the run was configured with (default: the run's config)")
    parser.add_argument("--at-tokens", type=float, default=None, metavar="T",
                        help="print the predicted peak per phase and rank at T tokens per micro-batch instead")
    parser.add_argument("--seq-len", type=float, default=None, metavar="L",
                        help="with --at-tokens: the micro-batch's sequences are L tokens long, its sum of squared "
                             "lengths T*L (default: the mean Q/T of the windows seen, as the advice assumes)")
    parser.add_argument("--phase", action="append", default=None, metavar="P",
                        help="only this phase (repeatable; default: every phase told its micro-batches)")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="the run the advice is for ends at step N: where the memory held between steps grows "
                             "(by rankmem leaks' test), its growth to step N is kept free too (default: none kept)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="leave out the first N logged steps (default 2)")
    parser.add_argument("--memory", choices=("auto", "host", "device"), default="auto",
                        help="fit the device's peak allocated or the host's peak RSS (default: device where measured)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per phase and rank")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also name each window left out of the fit (an absurd figure, work not counted)")


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (("--capacity", args.capacity, 0.0), ("--at-tokens", args.at_tokens, 0.0)):
        if value is not None and not (math.isfinite(value) and value > low):
            raise RankmemError(f"{flag} must be a finite number > 0, got {value}")
    if args.seq_len is not None:
        if args.at_tokens is None:
            raise RankmemError("--seq-len goes with --at-tokens T: the length of the sequences a micro-batch "
                               "of T holds")
        if not (math.isfinite(args.seq_len) and 1 <= args.seq_len <= args.at_tokens):
            raise RankmemError(f"--seq-len must be a number of tokens from 1 to --at-tokens ({args.at_tokens:g}), "
                               f"got {args.seq_len}")
    if args.headroom is not None and not (math.isfinite(args.headroom) and args.headroom >= 0):
        raise RankmemError(f"--headroom must be a finite number of GiB >= 0, got {args.headroom}")
    if args.budget is not None and args.budget < 1:
        raise RankmemError(f"--budget must be a number of tokens >= 1, got {args.budget}")
    if args.steps is not None and args.steps < 1:
        raise RankmemError(f"--steps must be a step number >= 1, got {args.steps}")
    if args.warmup < 0:
        raise RankmemError(f"--warmup must be >= 0, got {args.warmup}")


def run(args: argparse.Namespace) -> int:
    from rankmem.offline import read_run
    from rankmem.offline.advice import fit_ranks, work_phases

    _check(args)
    the_run = read_run(args.run)
    require_steps(the_run, "advise")
    if the_run.gaps:
        note_damage(the_run, "advise")
    phases = work_phases(the_run)
    if not phases:
        raise RankmemError(f"no phase of {args.run} was told its micro-batches: call monitor.micro_batch(tokens, ...) "
                           f"once per micro-batch inside each phase (rankmem train: --ppo-max-token-len-per-gpu)")
    if args.phase:
        unknown = [p for p in args.phase if p not in phases]
        if unknown:
            raise RankmemError(f"--phase {unknown[0]}: no such phase with micro-batches in the run; it has: "
                               f"{', '.join(phases)}")
        phases = [p for p in phases if p in args.phase]
    kind = None if args.memory == "auto" else args.memory
    fits = {p: fit_ranks(the_run, p, args.warmup, kind=kind) for p in phases}
    if args.at_tokens is not None:
        return _at_tokens(fits, args)
    return _advise(the_run, fits, args)


def _at_tokens(fits: dict[str, list[PhaseFit]], args: argparse.Namespace) -> int:
    from rankmem.fit.model import Fit

    t = float(args.at_tokens)
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    status = 0
    for phase, per_rank in fits.items():
        for pf in per_rank:
            head = f"{phase} rank {pf.rank}"
            why = _no_prediction(pf, t, args.seq_len)
            if why is not None:
                status = NO_VERDICT
                rows.append({"phase": phase, "rank": pf.rank, "tokens": t, "reason": why})
                lines.append(f"{head}: {why}")
                continue
            assert isinstance(pf.model, Fit)
            q = t * args.seq_len if args.seq_len is not None else None
            peak, low, high = pf.peak(t, q)
            row = {"phase": phase, "rank": pf.rank, "tokens": t, "predicted_peak_gib": peak, "low_gib": low,
                   "high_gib": high, "quadratic": pf.model.quadratic}
            if args.seq_len is not None:
                row["seq_len"] = args.seq_len
            rows.append(row)
            at = f"T={t:.0f}" + (f" in sequences of {args.seq_len:.0f}" if args.seq_len is not None else "")
            lines.append(f"{head}: {at}: predicted peak {peak:.3f} GiB ({low:.3f}..{high:.3f}), "
                         f"{'quadratic' if pf.model.quadratic else 'line'} fit of {pf.model.n} windows")
    print(json.dumps(rows, indent=1) if args.json else "\n".join(lines))
    return status


def _no_prediction(pf: PhaseFit, t: float, seq_len: float | None) -> str | None:
    """Why ``--at-tokens`` has no prediction for this rank: no model, or T (or the sequences' length)
    past 1.5x what its windows saw; None where it has one."""
    from rankmem.fit.model import NoFit
    from rankmem.offline.advice import EXTRAPOLATION

    if isinstance(pf.model, NoFit):
        return f"no model: {pf.model.reason}"
    cap = EXTRAPOLATION * pf.model.t_max
    if t > cap:
        return (f"T={t:.0f} is past {EXTRAPOLATION:g}x the largest T seen ({pf.model.t_max:.0f}): "
                f"run a step at T={cap:.0f} first")
    # Q = T*L: L stands where a window's Q/T (its token-weighted mean length) stood.
    longest = pf.model.q_per_token
    uses_q = pf.model.quadratic or pf.model.rival is not None  # a line's rival is quadratic, in its interval
    if seq_len is not None and uses_q and seq_len > EXTRAPOLATION * longest:
        return (f"sequences of {seq_len:.0f} tokens are past {EXTRAPOLATION:g}x the longest seen "
                f"(Q/T {longest:.0f}): run a step with sequences of {EXTRAPOLATION * longest:.0f} first")
    return None


def _advise(run: Run, fits: dict[str, list[PhaseFit]], args: argparse.Namespace) -> int:
    from rankmem.fit.capacity import verdict
    from rankmem.offline.advice import Advice, advise_rank, memory_kind, run_limit

    kind = args.memory if args.memory != "auto" else memory_kind(run, next(iter(fits)))
    limit = run_limit(run, kind, args.capacity, args.headroom)
    what = "the device's peak allocated + allocator overhead + memory outside torch" if kind == "device" else "peak RSS"
    lines = [f"capacity {limit.capacity:.3f} GiB per rank ({limit.source}), headroom {limit.headroom:.3f} GiB: "
             f"usable {limit.usable:.3f} GiB against {what}"]
    rows: list[dict[str, Any]] = []
    status = 0
    growth = _growth(run, args, kind, limit)
    lines += _growth_lines(run, growth, args)
    for phase, per_rank in fits.items():
        results = [advise_rank(pf, _kept(limit, pf, growth.get(pf.rank), args.steps)) for pf in per_rank]
        judged = verdict(per_rank, limit)  # as report, watch and the online warning judge it
        failed = [(pf.rank, r) for pf, r in zip(per_rank, results, strict=True) if isinstance(r, str)]
        advised = [r for r in results if isinstance(r, Advice)]
        for rank, reason in failed:
            rows.append({"phase": phase, "rank": rank, "max_tokens": None, "reason": reason,
                         "growth_mib_per_step": growth[rank].slope_mib if rank in growth else 0.0})
        if failed:
            status = NO_VERDICT
            rank, reason = failed[0]
            lines.append(f"{phase}: no advice: rank {rank}: {reason}")
            continue
        binding = min(advised, key=lambda a: (a.max_tokens, a.rank))
        phase_rows, phase_lines = _phase_advice(run, phase, per_rank, advised, binding, args)
        for row in phase_rows:  # the growth between steps found on its rank (0: none), MiB per step
            row["growth_mib_per_step"] = growth[row["rank"]].slope_mib if row["rank"] in growth else 0.0
        rows += [{**row, "fits": judged.fits} for row in phase_rows]
        lines += [*phase_lines, f"  {judged.describe(limit)}"]
    if args.verbose and not args.json:
        lines += _left_out_lines(run, fits, args)
    print(json.dumps(rows, indent=1) if args.json else "\n".join(lines))
    return status


def _left_out_lines(run: Run, fits: dict[str, list[PhaseFit]], args: argparse.Namespace) -> list[str]:
    from rankmem.fit.series import left_out

    kind = None if args.memory == "auto" else args.memory
    out = []
    for phase in fits:
        found = left_out(run.series, run.steps, phase, min(args.warmup, run.steps.size), kind)
        out += [f"{phase}: left out of the fit: {line}" for line in found] or [f"{phase}: no window left out"]
    return out


def _growth(run: Run, args: argparse.Namespace, kind: str, limit: Limit) -> dict[int, Trend]:
    from rankmem.offline.advice import baseline_growth

    found = {r: baseline_growth(run, r, args.warmup, kind, limit.capacity) for r in range(run.world_size)}
    return {r: t for r, t in found.items() if t is not None}


def _kept(limit: Limit, pf: PhaseFit, growth: Trend | None, steps: int | None) -> Limit:
    """The limit less the growth still to come by step ``steps`` (none asked or none found: unchanged)."""
    from rankmem.fit.capacity import Limit
    from rankmem.offline.advice import growth_ahead_gib

    if growth is None or steps is None:
        return limit
    return Limit(limit.capacity, limit.source, limit.headroom + growth_ahead_gib(pf, growth, steps))


def _growth_lines(run: Run, growth: dict[int, Trend], args: argparse.Namespace) -> list[str]:
    out = []
    for rank, t in growth.items():
        line = (f"rank {rank}: what it holds between steps grows {t.slope_mib:+.3f} MiB/step "
                f"(p={t.p_value:.1e}, steps {t.first_step}..{t.last_step}; see rankmem leaks {run.path})")
        if args.steps is None:
            line += ": not kept free; --steps N keeps its growth to step N"
        else:
            line += f": its growth to step {args.steps} is kept free"
        out.append(line)
    return out


def _phase_advice(run: Run, phase: str, per_rank: list[PhaseFit], advised: list[Any], binding: Any,
                  args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    from rankmem.offline.budget import configured_budget, micro_batch_size, overshoot, verl_names

    budget = args.budget if args.budget is not None else configured_budget(run, phase)
    over = overshoot(run, phase, budget, args.warmup) if budget is not None else 1.0
    advised_budget = int(binding.max_tokens / over)
    longest = _longest(run, per_rank)
    mbs = micro_batch_size(binding.max_tokens, longest) if longest else None
    fit = per_rank[binding.rank].model
    shape = "quadratic" if getattr(fit, "quadratic", False) else "line"
    # Capped, the crossing lies past what the fit may say: an interval of three equal numbers says nothing.
    where = ("at least " if binding.capped else "") + f"{binding.max_tokens} tokens in the heaviest micro-batch"
    if not binding.capped:
        where += f" (interval {binding.max_tokens}..{binding.high_tokens}, point {binding.point_tokens})"
    lines = [f"{phase}: {where}; binding rank {binding.rank}, predicted peak {binding.predicted_peak_gib:.3f} GiB "
             f"(high {binding.high_gib:.3f}); {shape} fit"]
    if binding.capped:
        lines.append(f"  capped at {binding.cap} = 1.5x the largest T seen: run a step at T={binding.cap} first "
                     f"to advise beyond")
    if budget is not None:
        lines.append(f"  realised micro-batches up to {over:.3f}x the budget {budget}: budget = {binding.max_tokens} / "
                     f"{over:.3f}")
    else:
        lines.append("  no configured budget known (--budget TOKENS names it): overshoot not applied")
    names = verl_names(phase)
    framework = _framework(run)
    setting = _framework_setting(framework, advised_budget, per_rank)
    if setting is not None:
        lines.append(f"  {setting[0]}={setting[1]}  # {setting[2]}")
    elif names is not None and framework.get("name") in (None, "", "verl"):
        lines += [f"  {name}={advised_budget}" for name in names.budget]
        if mbs is not None:
            lines += [f"  {name}={mbs}  # fixed-size form: sequences of up to {longest:.0f} tokens"
                      for name in names.micro_batch]
    else:
        lines.append(f"  phase {phase!r} has no {framework.get('name') or 'framework'} setting of its own: "
                     f"max tokens per micro-batch: {advised_budget}")
    rows = [{"phase": phase, "rank": a.rank, "max_tokens": a.max_tokens, "point_tokens": a.point_tokens,
             "high_tokens": a.high_tokens, "capped": a.capped, "binding": a is binding,
             "predicted_peak_gib": a.predicted_peak_gib, "high_gib": a.high_gib, "budget": budget, "overshoot": over,
             "advised_budget": int(a.max_tokens / over),
             "verl": {n: int(a.max_tokens / over) for n in (names.budget if names else ())},
             "setting": dict([setting[:2]]) if a is binding and setting is not None else {}} for a in advised]
    return rows, lines


def _framework(run: Run) -> dict[str, Any]:
    """The framework the integration named in the header (``{}``: none, as verl or a loop of your own)."""
    run_config = run.header.config.get("run")
    found = run_config.get("framework") if isinstance(run_config, dict) else None
    return found if isinstance(found, dict) else {}


FRAMEWORK_SETTINGS = {"hf": ("TrainingArguments.per_device_train_batch_size", "TrainingArguments"),
                      "lightning": ("DataLoader.batch_size", "the DataLoader")}
"""The setting that sizes a micro-batch in each framework, and where packed tokens are set."""


def _framework_setting(framework: dict[str, Any], tokens: int,
                       per_rank: list[PhaseFit]) -> tuple[str, Any, str] | None:
    """(setting, value, why) in the framework's own words: padded batches as sequences per micro-batch at
    the longest padded width seen (a padded micro-batch's Q/T is its width), packed ones as tokens."""
    from rankmem.fit.model import Fit

    names = FRAMEWORK_SETTINGS.get(str(framework.get("name")))
    if names is None:
        return None
    if framework.get("batches") != "padded":
        return ("tokens per packed micro-batch", tokens,
                f"set in {names[1]} as the batch size x the packed length")
    width = max((pf.model.q_per_token for pf in per_rank if isinstance(pf.model, Fit)), default=0.0)
    if width < 1:
        return None
    return names[0], int(tokens // round(width)), (
        f"micro-batches padded to {width:.0f} tokens, the longest seen")


def _longest(run: Run, per_rank: list[PhaseFit]) -> float:
    """The longest sequence: the run's ``max_seq_len`` where it says, else the bound sqrt(largest Q) seen."""
    run_config = run.header.config.get("run") or {}
    value = run_config.get("max_seq_len") if isinstance(run_config, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return math.sqrt(max(pf.sq_max for pf in per_rank))
