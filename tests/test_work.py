"""Work beside memory: ``Monitor.micro_batch`` reaches the run log per rank, under the catalogue's keys."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import rankmem
from rankmem.core.catalogue import WORK_FIELDS, work_key
from rankmem.offline import read_run
from tests.conftest import REPO, torchrun
from tests.dist_scripts.work_worker import lengths


def test_each_rank_s_heaviest_micro_batch_and_totals_reach_the_run_log(tmp_path: Path) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/work_worker.py", 3, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(str(tmp_path))
    assert list(run.steps) == [0, 1, 2]
    for field in WORK_FIELDS:
        assert work_key("update", field) in run.series
    for step in range(3):
        for rank in range(3):
            mbs = lengths(rank, step)
            heaviest = max(mbs, key=sum)
            got = {f: run.series[work_key("update", f)][step, rank] for f in WORK_FIELDS}
            assert got == {"mb_tokens": sum(heaviest), "mb_sequences": len(heaviest),
                           "mb_sq_tokens": max(sum(s * s for s in mb) for mb in mbs),
                           "tokens": sum(map(sum, mbs)), "micro_batches": len(mbs)}
            assert run.series[work_key("log_prob", "mb_tokens")][step, rank] == 100 * (rank + 1)
    # Not told: absent, never 0.
    assert work_key("log_prob", "mb_sq_tokens") not in run.series


def test_q_is_the_largest_of_any_micro_batch_not_the_heaviest_s() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    with monitor.step(0), monitor.phase("update"):
        monitor.micro_batch(100, 4, 4 * 25**2)  # the heaviest by tokens: four short sequences
        monitor.micro_batch(90, 1, 90**2)  # fewer tokens, one long sequence: the larger Q
        monitor.micro_batch(80)  # told no Q: leaves the largest alone
    got = monitor.local_metrics()
    monitor.close()
    assert got[work_key("update", "mb_tokens")] == 100.0
    assert got[work_key("update", "mb_sequences")] == 4.0
    assert got[work_key("update", "mb_sq_tokens")] == 8100.0


def test_the_innermost_phase_keeps_it_and_a_phase_run_twice_keeps_the_heavier() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    with monitor.step(0):
        with monitor.phase("outer"):
            with monitor.phase("inner"):
                monitor.micro_batch(50, 2, 1300)
            monitor.micro_batch(10)
        with monitor.phase("outer"):
            monitor.micro_batch(30, 1, 900)
    got = monitor.local_metrics()
    monitor.close()
    assert got[work_key("inner", "mb_tokens")] == 50.0
    assert got[work_key("outer", "mb_tokens")] == 30.0
    assert got[work_key("outer", "mb_sq_tokens")] == 900.0
    assert got[work_key("outer", "tokens")] == 40.0
    assert got[work_key("outer", "micro_batches")] == 2.0


def test_outside_a_phase_it_is_ignored_with_one_warning_and_bad_numbers_are_refused() -> None:
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monitor.step(0):
            monitor.micro_batch(10)
            monitor.micro_batch(10)
    assert [str(w.message) for w in caught] == [
        "rankmem: micro_batch() outside a phase is ignored: call it inside monitor.phase(...), where the "
        "phase's peak is measured"]
    assert not [k for k in monitor.local_metrics() if k.endswith("_tokens")]
    # A bad count never stops training: refused with one warning, the window's work left unknown (NaN).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monitor.step(1), monitor.phase("update"):
            monitor.micro_batch(10)
            for bad in (-1, float("nan"), "x", True, 2.0**41):
                monitor.micro_batch(bad)  # type: ignore[arg-type]
    assert [str(w.message) for w in caught] == [
        "rankmem: micro_batch(tokens=...) must be a number in 0..1e+12, got -1: refused; the window it was "
        "told in is left out of the advice fit (its work keys are NaN)"]
    assert math.isnan(monitor.local_metrics()["mem/phase/update/heaviest_mb_tokens"])
    monitor.close()
