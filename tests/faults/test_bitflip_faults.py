"""Issue 20, "a flipped bit read as truth, or a crash": seeded single-bit flips over a real run's side
file and run log. Each flip is read by ``rankmem report``, ``leaks``, ``watch`` (and ``plot`` on some)
through the real CLI in a subprocess of its own (a crash must be seen as one). What
each says is compared with what it says of the undamaged run: it must say the same, or note the damage
(a note, a skipped line, a refused file in one line); a different answer without a note is a misread.
None may misread, none may crash. The default selection reads the first 100 of the 400 flips;
``pytest -m slow`` reads all 400."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankmem.runlog.layout import DETAIL_NAME, RUN_LOG_NAME
from tests.conftest import REPO
from tests.runlog_helpers import known_run

FLIPS = 400
PLOT_EVERY = 25
WORKER = Path(__file__).with_name("_bitflip_worker.py")


def _flips(run: Path, seed: int, count: int) -> list[dict[str, Any]]:
    """The clean run first, then the first ``count`` of FLIPS flips spread over both files by their sizes."""
    sizes = {name: (run / name).stat().st_size for name in (DETAIL_NAME, RUN_LOG_NAME)}
    total = sum(sizes.values())
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = [{"file": None, "byte": 0, "bit": 0, "plot": True}]
    for i, at in enumerate(rng.choice(total, FLIPS, replace=False).tolist()):
        name = DETAIL_NAME if at < sizes[DETAIL_NAME] else RUN_LOG_NAME
        byte = at if name == DETAIL_NAME else at - sizes[DETAIL_NAME]
        out.append({"file": name, "byte": byte, "bit": int(rng.integers(8)), "plot": i % PLOT_EVERY == 0})
    return out[:count + 1]


def _run_all(run: Path, flips: list[dict[str, Any]], tmp: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every flip's result, and the flips that killed the worker (it is restarted after each)."""
    results: list[dict[str, Any]] = []
    killed: list[dict[str, Any]] = []
    todo = list(flips)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    while todo:
        spec, out = tmp / "flips.json", tmp / "results.jsonl"
        spec.write_text(json.dumps(todo))
        out.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, str(WORKER), str(run), str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=900)
        lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        done = [r for r in lines if "flip" in r]
        results += done
        if proc.returncode == 0:
            break
        started = [r["start"] for r in lines if "start" in r]
        assert len(started) == len(done) + 1, proc.stderr[-2000:]
        killed.append({"flip": started[-1], "rc": proc.returncode, "stderr": proc.stderr[-500:]})
        todo = todo[len(started):]
    return results, killed


def _one_line_refusal(result: dict[str, Any]) -> bool:
    """Exit 2 with one error line (after the notes of what was damaged), no traceback."""
    err = [line for line in result["err"].strip().splitlines() if ": note: " not in line]
    return len(err) == 1 and ": error: " in err[0]


def _verdict(clean: dict[str, Any], got: dict[str, Any]) -> str:
    """"same", "noted", "misread" or "crash" for one flip, over every command."""
    verdicts = []
    for command in ("report", "leaks", "watch", "plot"):
        if command not in got:
            continue
        r = got[command]
        if r["rc"] == 2:
            verdicts.append("noted" if _one_line_refusal(r) else "crash")
        elif r["rc"] not in ((0, 1, 3) if command == "leaks" else (0,)) or "Traceback" in r["err"]:
            verdicts.append("crash")
        elif command == "report":
            report, want = json.loads(r["out"]), json.loads(clean["report"]["out"])
            noted = bool(report["detail_note"] or report["corrupt"] or report["truncated"])
            verdicts.append("same" if report == want else "noted" if noted else "misread")
        elif command == "leaks":
            verdicts.append("same" if r["out"] == clean["leaks"]["out"] else "noted" if "note:" in r["err"]
                            else "misread")
    if got.get("frame") is None:
        verdicts.append("crash")
    elif got["frame"] != clean["frame"]:
        verdicts.append("noted" if got["frame"]["detail_note"] else "misread")
    for worst in ("crash", "misread", "noted"):
        if worst in verdicts:
            return worst
    return "same"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("count", [pytest.param(FLIPS, marks=pytest.mark.slow, id="400-flips"),
                                   pytest.param(100, id="100-flips")])
def test_single_bit_flips_in_a_run_are_never_misread_and_never_crash(tmp_path: Path, count: int) -> None:
    run = tmp_path / "run"
    run.mkdir()
    known_run(run)
    flips = _flips(run, seed=20, count=count)
    results, killed = _run_all(run, flips, tmp_path)
    assert not killed, f"{len(killed)} flip(s) killed the reader: {killed[:3]}"
    clean = results[0]
    assert clean["report"]["rc"] == 0 and clean["frame"]["detail_note"] is None
    assert json.loads(clean["report"]["out"])["detail_note"] is None
    counts = {"same": 0, "noted": 0, "misread": 0, "crash": 0}
    bad = []
    for got in results[1:]:
        verdict = _verdict(clean, got)
        counts[verdict] += 1
        if verdict in ("misread", "crash"):
            bad.append((verdict, got["flip"], {k: v for k, v in got.items() if k != "flip"}))
    by_file = {name: sum(f["file"] == name for f in flips[1:]) for name in (DETAIL_NAME, RUN_LOG_NAME)}
    print(f"{count} single-bit flips ({by_file}): {counts}")
    assert len(results) == count + 1
    assert not bad, f"{counts}; " + "\n".join(json.dumps(b, default=str)[:1500] for b in bad[:4])
    assert counts["noted"] > 0  # flips that hit values and framing are found, not all harmless
