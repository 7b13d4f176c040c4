"""``rankmem advise``: exact output on run logs whose memory follows a known line, the verdicts, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.core.catalogue import key_of, phase_key, work_key
from tests.runlog_helpers import write_run

PER_TOKEN = 100 / 2**20  # GiB: 100 KiB per token
BASE = (1.0, 1.1)  # GiB resident between steps, per rank
FIXED = 0.2  # GiB the update phase adds whatever its tokens


def line_run(out: Path, steps: int = 12, budget: int = 2048, phase: str = "update",
             run: dict[str, object] | None = None) -> Path:
    i = np.arange(steps, dtype=np.float64)[:, None]
    tokens = 1000 + 200 * i + 50 * np.arange(2)[None, :]
    jitter = np.where((np.arange(steps) % 2)[:, None] == 0, 0.5, -0.5) / 1024  # +-0.5 MiB
    rss = np.tile(np.array(BASE), (steps, 1))
    series = {
        key_of("rss"): rss,
        key_of("node_used"): np.full((steps, 2), 6.0),
        key_of("node_available"): np.full((steps, 2), 10.0),
        phase_key(phase, "peak_rss_gib"): rss + FIXED + PER_TOKEN * tokens + jitter,
        work_key(phase, "mb_tokens"): tokens,
        work_key(phase, "mb_sequences"): np.full((steps, 2), 8.0),
        work_key(phase, "mb_sq_tokens"): tokens * 64,  # every sequence 64 tokens: Q cannot be told from T
    }
    config = run if run is not None else {"ppo_max_token_len_per_gpu": budget, "max_seq_len": 64}
    write_run(out, series, config={"run": config})
    return out


def advise(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["advise", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_capped_advice_names_verl_s_keys_the_binding_rank_and_the_overshoot(tmp_path: Path, capsys) -> None:
    rc, out, _ = advise(capsys, str(line_run(tmp_path)))
    assert rc == 0
    lines = out.splitlines()
    # Node total 16 GiB, of which 6 - (1.0 + 1.1) = 3.9 GiB held by other processes, the rest shared by the
    # 2 ranks on node0; headroom 5%. Largest T after warm-up: 3200 on rank 0, 3250 on rank 1; the line
    # fits far past 1.5x either, and the ranks share its slope, so the cap is 1.5x the largest T of any
    # rank (rank 1's), on both: rank 0, the lower, binds.
    assert lines[0] == ("capacity 6.050 GiB per rank (node total less 3.900 GiB of other processes / 2 ranks), "
                        "headroom 0.302 GiB: usable 5.747 GiB against peak RSS")
    assert lines[1].startswith("update: at least 4875 tokens in the heaviest micro-batch; binding rank 0, "
                               "predicted peak ")
    assert lines[1].endswith("; line fit")
    assert lines[2:] == [
        "  capped at 4875 = 1.5x the largest T seen: run a step at T=4875 first to advise beyond",
        "  realised micro-batches up to 1.587x the budget 2048: budget = 4875 / 1.587",
        "  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3072",
        "  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=76  # fixed-size form: sequences of up to 64 tokens",
        "  update: fits: fitted peak at its heaviest micro-batch seen (3250 tokens, rank 1) 1.633 GiB of "
        "usable 5.747",
    ]
    assert int(4875 / (3250 / 2048)) == 3072 and 4875 // 64 == 76


@pytest.mark.parametrize(("framework", "line"), [
    ({"name": "hf", "batches": "padded"},  # Q/T = 64: micro-batches padded to 64 tokens
     "  TrainingArguments.per_device_train_batch_size=76  # micro-batches padded to 64 tokens, "
     "the longest seen"),
    ({"name": "lightning", "batches": "padded"},
     "  DataLoader.batch_size=76  # micro-batches padded to 64 tokens, the longest seen"),
    ({"name": "hf", "batches": "packed"},
     "  tokens per packed micro-batch=4875  # set in TrainingArguments as the batch size x the "
     "packed length"),
    (None, "  phase 'train_step' has no framework setting of its own: max tokens per micro-batch: 4875"),
])
def test_the_advice_names_the_framework_s_setting(tmp_path: Path, capsys, framework: object,
                                                  line: str) -> None:
    """The setting in the words of the framework the integration named in the header; none: said plainly.
    Capped at 1.5 x 3250 = 4875 tokens; 4875 // 64 = 76 sequences of 64."""
    run = {} if framework is None else {"framework": framework}
    rc, out, _ = advise(capsys, str(line_run(tmp_path, phase="train_step", run=run)), "--json")
    assert rc == 0
    binding = next(r for r in json.loads(out) if r["binding"])
    rc, out, _ = advise(capsys, str(tmp_path))
    assert out.splitlines()[-2] == line  # the last: the verdict line
    if framework is None:
        assert binding["setting"] == {}
    else:
        name, value = line.split("=", 1)
        assert binding["setting"] == {name.strip(): int(value.split()[0])}


def test_advice_where_capacity_binds_is_below_the_exact_crossing(tmp_path: Path, capsys) -> None:
    rc, out, _ = advise(capsys, str(line_run(tmp_path)), "--capacity", "1.5", "--headroom", "0.1", "--json")
    assert rc == 0
    rows = json.loads(out)
    by_rank = {r["rank"]: r for r in rows}
    # The peak reaches 1.4 GiB at T = (1.4 - base - 0.2) / (100 KiB): 2097.15 on rank 0, 1048.58 on rank 1.
    # The +-0.5 MiB jitter moves the fit by a fraction of a MiB: a few tokens (100 KiB each).
    assert abs(by_rank[0]["point_tokens"] - 2097) <= 3 and abs(by_rank[1]["point_tokens"] - 1048) <= 3
    assert [r["binding"] for r in rows] == [False, True]
    binding = by_rank[1]
    # The interval's high end reaches the limit first: below the crossing by its half-width, ~2.3 x 2% of
    # the ~0.3 GiB rise (run-to-run noise) in quadrature with the ~1 MiB residual = ~14 MiB = ~145 tokens.
    assert 1048 - 200 < binding["max_tokens"] < 1048 - 60
    assert binding["high_gib"] == pytest.approx(1.4, abs=1e-6)
    assert binding["overshoot"] == pytest.approx(3250 / 2048)
    budget = int(binding["max_tokens"] / (3250 / 2048))
    assert binding["verl"] == {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": budget}


def test_at_tokens_predicts_the_peak_and_refuses_past_1_5x(tmp_path: Path, capsys) -> None:
    run = str(line_run(tmp_path))
    rc, out, _ = advise(capsys, run, "--at-tokens", "4000", "--json")
    assert rc == 0
    for row in json.loads(out):
        truth = BASE[row["rank"]] + FIXED + PER_TOKEN * 4000
        assert row["tokens"] == 4000 and abs(row["predicted_peak_gib"] - truth) < 1 / 1024
        rise = FIXED + PER_TOKEN * 4000
        # +- t(0.975, 8) x (2% of the rise, in quadrature with the ~1 MiB residual scale): the rank's own
        # scale, over its 10 windows less its intercept and its share of the slope both ranks fit
        assert row["low_gib"] < truth < row["high_gib"]
        assert 2 * 2.3 * 0.02 * rise < row["high_gib"] - row["low_gib"] < 2 * 2.4 * (0.02 * rise + 2 / 1024)
    rc, out, _ = advise(capsys, run, "--at-tokens", "10000")
    assert rc == 3
    # The ranks share the slope: the largest T seen is rank 1's 3250 on both.
    assert out.splitlines() == [
        "update rank 0: T=10000 is past 1.5x the largest T seen (3250): run a step at T=4875 first",
        "update rank 1: T=10000 is past 1.5x the largest T seen (3250): run a step at T=4875 first",
    ]


def quadratic_run(out: Path) -> Path:
    """One rank whose rise is 0.1 GiB + 50 KiB per token + 200 B per squared sequence length, on windows
    whose sequence length (64, 128 or 256) varies apart from their tokens."""
    steps = 14
    t = 1000.0 + 150 * np.arange(steps)
    length = np.array([64.0, 256.0, 128.0])[np.arange(steps) % 3]
    q = t * length
    rise = 0.1 + 50 * t / 2**20 + 200 * q / 2**30
    series = {
        key_of("rss"): np.full((steps, 1), 1.0),
        key_of("node_used"): np.full((steps, 1), 2.0),
        key_of("node_available"): np.full((steps, 1), 10.0),
        phase_key("update", "peak_rss_gib"): (1.0 + rise)[:, None],
        work_key("update", "mb_tokens"): t[:, None],
        work_key("update", "mb_sequences"): (t / length)[:, None],
        work_key("update", "mb_sq_tokens"): q[:, None],
    }
    write_run(out, series)
    return out


def test_at_tokens_in_sequences_of_a_given_length(tmp_path: Path, capsys) -> None:
    run = str(quadratic_run(tmp_path))
    for length in (64, 256):
        rc, out, _ = advise(capsys, run, "--at-tokens", "3000", "--seq-len", str(length), "--json")
        assert rc == 0
        [row] = json.loads(out)
        truth = 1.0 + 0.1 + 50 * 3000 / 2**20 + 200 * 3000 * length / 2**30
        assert (row["seq_len"], row["quadratic"]) == (length, True)
        assert abs(row["predicted_peak_gib"] - truth) < 1 / 1024 and row["low_gib"] < truth < row["high_gib"]
    rc, out, _ = advise(capsys, run, "--at-tokens", "3000", "--seq-len", "400")
    assert (rc, out) == (3, "update rank 0: sequences of 400 tokens are past 1.5x the longest seen (Q/T 256): "
                            "run a step with sequences of 384 first\n")


def test_too_few_windows_is_one_line_and_exit_3(tmp_path: Path, capsys) -> None:
    rc, out, _ = advise(capsys, str(line_run(tmp_path, steps=6)))
    assert rc == 3
    assert out.splitlines()[1:] == [
        "update: no advice: rank 0: 4 window(s) with tokens after warm-up, the fit needs 6: run more steps"]


@pytest.mark.parametrize("args, message", [
    (["--capacity", "-1"], "--capacity must be a finite number > 0, got -1.0"),
    (["--headroom", "nan"], "--headroom must be a finite number of GiB >= 0, got nan"),
    (["--budget", "0"], "--budget must be a number of tokens >= 1, got 0"),
    (["--phase", "rollout"], "--phase rollout: no such phase with micro-batches in the run; it has: update"),
    (["--capacity", "1", "--headroom", "2"], "--headroom 2 GiB leaves nothing of the capacity 1.000 GiB: lower it"),
    (["--seq-len", "64"], "--seq-len goes with --at-tokens T: the length of the sequences a micro-batch of T holds"),
    (["--at-tokens", "100", "--seq-len", "200"], "--seq-len must be a number of tokens from 1 to --at-tokens (100), "
                                                 "got 200.0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    rc, out, err = advise(capsys, str(line_run(tmp_path)), *args)
    assert (rc, out, err) == (2, "", f"rankmem advise: error: {message}\n")


def test_a_run_told_no_micro_batches_is_bad_input(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, {key_of("rss"): np.ones((4, 2))})
    rc, _, err = advise(capsys, str(tmp_path))
    assert rc == 2
    assert err == (f"rankmem advise: error: no phase of {tmp_path} was told its micro-batches: call "
                   "monitor.micro_batch(tokens, ...) once per micro-batch inside each phase (rankmem train: "
                   "--ppo-max-token-len-per-gpu)\n")


def test_a_cgroup_s_capacity_leaves_out_what_its_other_processes_hold(tmp_path: Path) -> None:
    """One rank in a 2 GiB cgroup whose working set is its RSS plus 0.25 GiB (the launcher, torchrun's
    agent, the side-file writer): the rank's capacity is 1.75 GiB, the most the others held subtracted."""
    from rankmem.offline import read_run
    from rankmem.offline.advice import run_limit

    steps = 8
    rss = np.linspace(1.0, 1.2, steps)[:, None]
    others = np.where(np.arange(steps) == 5, 0.25, 0.2)[:, None]
    write_run(tmp_path, {key_of("rss"): rss, key_of("cgroup_limit"): np.full((steps, 1), 2.0),
                         key_of("cgroup_working_set"): rss + others, key_of("cgroup_used"): rss + others + 0.5,
                         key_of("node_used"): np.full((steps, 1), 9.0), key_of("node_available"): np.full((steps, 1),
                                                                                                          7.0)},
              world=1)
    limit = run_limit(read_run(str(tmp_path)), "host")
    assert limit.capacity == pytest.approx(1.75)
    assert limit.source == "cgroup limit less 0.250 GiB of other processes"


def test_growth_between_steps_is_named_and_kept_free_to_the_step_asked(tmp_path: Path, capsys) -> None:
    """Rank 1's memory between steps grows 0.5 MiB a step (its peaks ride on it); rank 0's does not.
    Without --steps the advice says so and keeps nothing; with --steps 100, rank 1's true peak at step
    100 at the advised tokens (from the formula that made the run) stays within capacity minus headroom.
    The fit's windows (steps 2..39, mean 20.5) hold the growth to their mean step in their rises, so
    what is kept is 0.5 MiB x (100 - 20.5): 407 tokens at 100 KiB a token."""
    steps, grows = 40, 0.5 / 1024  # GiB per step, rank 1
    i = np.arange(steps, dtype=np.float64)[:, None]
    tokens = 1000 + 200 * (i % 10) + 0 * np.arange(2)[None, :]
    jitter = np.where((np.arange(steps) % 2)[:, None] == 0, 0.25, -0.25) / 1024
    rss = np.tile(np.array(BASE), (steps, 1)) + jitter
    rss[:, 1] += grows * np.arange(steps)
    series = {
        key_of("rss"): rss,
        phase_key("update", "peak_rss_gib"): rss + FIXED + PER_TOKEN * tokens,
        work_key("update", "mb_tokens"): tokens,
        work_key("update", "mb_sq_tokens"): tokens * 64,
    }
    run = write_run(tmp_path / "grows", series, config={"run": {"ppo_max_token_len_per_gpu": 4096}})
    capacity, headroom = 1.6, 0.05
    base_args = [str(run), "--capacity", str(capacity), "--headroom", str(headroom), "--json"]
    rc, out, _ = advise(capsys, *base_args)
    assert rc == 0
    before = {r["rank"]: r for r in json.loads(out)}
    assert before[0]["growth_mib_per_step"] == 0.0
    assert before[1]["growth_mib_per_step"] == pytest.approx(0.5, rel=0.05)
    rc, text, _ = advise(capsys, *base_args[:-1])
    assert rc == 0 and any(line.startswith("rank 1: what it holds between steps grows +0.50")
                           and line.endswith("not kept free; --steps N keeps its growth to step N")
                           for line in text.splitlines())
    rc, out, _ = advise(capsys, *base_args, "--steps", "100")
    assert rc == 0
    after = {r["rank"]: r for r in json.loads(out)}
    assert after[0]["max_tokens"] == before[0]["max_tokens"]
    fewer = before[1]["max_tokens"] - after[1]["max_tokens"]
    assert abs(fewer - 0.5 * (100 - 20.5) * 1024 / 100) <= 20, fewer
    true_peak_at_100 = BASE[1] + grows * 100 + FIXED + PER_TOKEN * after[1]["max_tokens"]
    assert true_peak_at_100 <= capacity - headroom, true_peak_at_100
    # Without --steps the same T would not have fitted at step 100: the growth is what it keeps.
    assert BASE[1] + grows * 100 + FIXED + PER_TOKEN * before[1]["max_tokens"] > capacity - headroom


def test_one_absurd_window_leaves_the_advice_as_the_clean_run_s(tmp_path: Path, capsys) -> None:
    """One window told tokens=1e300 (an overflowed counter) and a peak of 1e300 GiB on the other rank:
    both windows are left out of the fit, and the advice is the clean run's (the line fits exactly)."""
    import json

    from rankmem.offline import read_run

    rc, clean, _ = advise(capsys, str(line_run(tmp_path / "clean")), "--json")
    assert rc == 0
    run = read_run(str(line_run(tmp_path / "absurd")))
    series = {k: v.copy() for k, v in run.series.items()}
    series[work_key("update", "mb_tokens")][5, 0] = 1e300
    series[phase_key("update", "peak_rss_gib")][6, 1] = 1e300
    config = {"run": {"ppo_max_token_len_per_gpu": 2048, "max_seq_len": 64}}
    write_run(tmp_path / "absurd2", series, config=config)
    rc, absurd, err = advise(capsys, str(tmp_path / "absurd2"), "--json")
    assert rc == 0 and err == ""
    for a, c in zip(json.loads(absurd), json.loads(clean), strict=True):
        assert (a["rank"], a["verl"], a["overshoot"], a["advised_budget"]) == \
            (c["rank"], c["verl"], c["overshoot"], c["advised_budget"])
        interval = c["high_gib"] - c["predicted_peak_gib"]
        assert abs(a["predicted_peak_gib"] - c["predicted_peak_gib"]) < interval
    # -v names the two windows, and only them; the clean run has none.
    rc, text, _ = advise(capsys, str(tmp_path / "absurd2"), "-v")
    named = [line for line in text.splitlines() if "left out of the fit" in line]
    assert rc == 0 and named == [
        f"update: left out of the fit: step {run.steps[5]} rank 0: {work_key('update', 'mb_tokens')} = 1e+300, "
        "past any real figure",
        f"update: left out of the fit: step {run.steps[6]} rank 1: {phase_key('update', 'peak_rss_gib')} = 1e+300, "
        "past any real figure"], text
    rc, text, _ = advise(capsys, str(tmp_path / "clean"), "-v")
    assert rc == 0 and "update: no window left out" in text.splitlines()


def test_advise_v_names_the_window_whose_micro_batch_was_refused(tmp_path: Path, capsys) -> None:
    """A live Monitor told micro_batch(tokens=1e300) in one window: one warning, training goes on, and
    `advise -v` names that window as the one whose work was not counted."""
    import warnings

    import rankmem

    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rankmem.Monitor(out_dir=str(out), children=False, near_oom_watch=False) as monitor:
            for step in range(8):
                with monitor.step(step), monitor.phase("update"):
                    held = bytearray((1 + step % 3) << 20)
                    monitor.micro_batch(1e300 if step == 5 else 1024.0 * (1 + step % 3))
                    del held
                monitor.collect()
    assert sum("refused" in str(w.message) for w in caught) == 1
    rc, text, _ = advise(capsys, str(out), "-v", "--warmup", "0")
    named = [line for line in text.splitlines() if "left out of the fit" in line]
    assert named == ["update: left out of the fit: step 5 rank 0: its work was not counted (micro_batch refused "
                     "it or was not called)"], text
