"""Faults a long job meets, reproduced: misuse of collect() and bad values never hang or kill a rank
(issue 11, items 7-11). The launcher, sink, run-log and CLI faults of the same issue are in
``tests/faults/``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import rankmem
from tests.conftest import REPO, torchrun


def test_misuse_across_real_ranks_never_hangs(tmp_path: Path) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/faults_worker.py", 2, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # 10**400 on rank 1 is dropped with a warning there; rank 0's value is the only one.
    assert r0["huge"] == r1["huge"] == {"tokens/max": 5.0, "tokens/max_rank": 0.0, "ok/max": 1.0}
    assert any("'tokens' is not a scalar" in w for w in r1["warnings"])
    # A list instead of a dict on rank 0: its values are left out there, rank 1's loss still arrives.
    assert r0["not_a_dict_loss_max"] == r1["not_a_dict_loss_max"] == 2.0
    assert any("collect() takes a dict of metrics, got list" in w for w in r0["warnings"])
    assert r0["fork_child_status"] == 0  # the child got a RankmemError, not the parent's collective
    assert r0["subgroup"] == "collected"
    assert "not a member of the Monitor's group" in r1["subgroup"]
    assert r0["after"] == r1["after"] == 1.0


def test_keys_that_change_every_step_cost_no_pickled_gather_per_step(tmp_path: Path) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/faults_worker.py", 2, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["alternating"] == r1["alternating"]
    # Two new key sets (A, then B) are learned by pickled gathers; the other ten steps take the tensor path.
    assert r0["alternating_fallbacks"] == r1["alternating_fallbacks"] == 2
    assert r0["alternating_warnings"] <= 2 and r1["alternating_warnings"] <= 2
    for step, out in enumerate(r0["alternating"][:11]):
        key = "A" if step % 2 == 0 else "B"
        assert out[f"{key}/max"] == float(step) and out[f"{key}/max_rank"] == 1.0
        assert out[("B" if key == "A" else "A") + "/max"] is None  # a key no rank has this step is not reported
        assert out["loss/max_rank"] == 0.0
    assert r0["alternating"][11]["loss/max_rank"] == 0.0  # rank 0's NaN is its value, not "absent"


def test_a_bad_step_number_is_refused_at_entry_not_at_exit() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    entered = False
    with pytest.raises(rankmem.RankmemError, match="a step number must be an integer, got 'epoch-1'"):
        with monitor.step("epoch-1"):  # type: ignore[arg-type]
            entered = True
    assert not entered
    with pytest.raises(rankmem.RankmemError, match="a step number must fit in 64 bits, got 1180591620717411303424"):
        with monitor.step(2**70):
            entered = True
    assert not entered
    with pytest.raises(rankmem.RankmemError, match="a step number must be an integer, got 1.5"):
        monitor.set_step(1.5)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="the user's own"):  # a good step never replaces the body's exception
        with monitor.step(3):
            raise KeyError("the user's own")
    assert monitor.collect()["mem/host/rss_gib/max"] > 0
    monitor.close()


def test_collect_from_two_threads_at_once_is_refused() -> None:
    entered, release = threading.Event(), threading.Event()

    class SlowSink:
        def open(self, header: object) -> None:
            pass

        def write(self, record: object) -> None:
            entered.set()
            release.wait(30)

        def close(self) -> None:
            pass

    monitor = rankmem.Monitor(sinks=(SlowSink(),), device="cpu", children=False, sink_thread=False)
    first = threading.Thread(target=monitor.collect, args=({"loss": 1.0},))
    first.start()
    assert entered.wait(30)  # the first collect is inside its sink write, holding the collect
    with pytest.raises(rankmem.RankmemError, match="already running in another thread"):
        monitor.collect({"loss": 2.0})
    release.set()
    first.join(30)
    assert monitor.collect({"loss": 3.0})["loss/max"] == 3.0  # and the monitor goes on
    monitor.close()


def test_a_rank_that_calls_collect_once_more_is_named(tmp_path: Path) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/extra_collect_worker.py", 2, [str(tmp_path)], timeout=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    expected = "ranks met in one collect() at different steps (rank(s) [1] at step 1; rank(s) [0] at step 2)"
    assert any(w.startswith("rankmem: " + expected) for w in r0["warnings"]), (r0, proc.stderr[-2000:])
    assert any(w.startswith("rankmem: " + expected) for w in r1["warnings"])
