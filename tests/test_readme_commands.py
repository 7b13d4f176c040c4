"""Every command README shows runs as shown, in a fresh directory holding ``examples/``.

The commands are read from README itself: the lines of its ``bash`` blocks, the ``Run:`` lines of the
example files it includes, and inline code that launches an example (``torchrun ... examples/X.py``
or ``python -m torch.distributed.run ... examples/X.py``). Each runs verbatim but for:

- ``python`` / ``torchrun`` / ``rankmem`` become this interpreter's (``-m torch.distributed.run``,
  ``-m rankmem``), and torchrun's rendezvous port comes from ``PET_MASTER_PORT`` (a free port), so
  parallel test runs do not collide on the default 29500;
- ``rankmem train`` runs at most :data:`TRAIN_STEPS` steps (``make demo``'s 400 take minutes), and a
  multi-node line (``--nnodes 2``) is not run: it needs several machines (``tests/test_engine.py``
  forms a two-agent job on one);
- ``rankmem watch RUN`` (live) runs at a terminal (a pty) until it draws a frame, and is ended by SIGINT,
  as Ctrl-C would;
- ``make``, ``pip``, ``git`` and ``bash`` lines set up a machine and are not run here.

Commands that read ``runs/demo`` find a short ``rankmem train`` run there. Each example must leave a
run log the offline tools read (``--out``), and its framework's own output is checked.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_at_a_terminal, train_steps_cap
from tests.conftest import command_env as _env
from tests.runlog_helpers import read_log

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
"""What a user reads: README and the pages under docs/."""
TIMEOUT_S = 240
NOT_RUN = ("make", "pip", "git", "bash", "cd", "export", "source")

_FENCE = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", re.S)
_RUN_LINE = re.compile(r"^Run:\s+(.+)$", re.M)
_INLINE = re.compile(r"`((?:torchrun|python -m torch\.distributed\.run) [^`]*examples/[^`]+)`")


def readme_commands() -> list[str]:
    text = README.read_text()  # docs/'s commands: tests/test_docs_commands.py
    found: list[str] = []
    for block in _FENCE.findall(text):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                found.append(line.removeprefix("$ "))
    for _, code in _EXAMPLE.findall(text):
        found += [m.strip() for m in _RUN_LINE.findall(code)]
    found += [m.strip() for m in _INLINE.findall(text)]
    return list(dict.fromkeys(found))


COMMANDS = readme_commands()


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "rankmem":
        return [sys.executable, "-m", "rankmem", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    return words


def _option(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def test_readme_shows_how_to_run_every_example() -> None:
    shown = {w for c in COMMANDS for w in shlex.split(c) if w.startswith("examples/") and w.endswith(".py")}
    assert shown == {f"examples/{p.name}" for p in (REPO / "examples").glob("*.py")}, shown
    assert any(c.startswith("rankmem report ") for c in COMMANDS)
    assert any(c.startswith("rankmem plot ") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_shown(command: str, demo_workdir: Path, once_in_demo: Any) -> None:
    words = shlex.split(command)
    if words[0] in NOT_RUN:
        pytest.skip(f"sets up a machine: {command}")
    if words[:2] == ["rankmem", "train"] and (_option(words, "--nnodes") or "1") != "1":
        pytest.skip("several nodes: tests/test_engine.py forms a two-agent job on one machine")
    argv = _argv(command)
    argv += train_steps_cap(words)
    if words[:2] == ["rankmem", "watch"] and "--once" not in words:
        _live_watch(argv, demo_workdir)
        return
    if words[:2] == ["rankmem", "train"]:  # the samples' and docs/advice.md's run too: launched once
        done = once_in_demo(argv)
    else:
        done = subprocess.run(argv, cwd=demo_workdir, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    # leaks answers "yes" with exit 1; advise on the demo's fixed micro-batches has no verdict (3), saying why
    ok = {"leaks": (0, 1), "advise": (3,) if "runs/demo" in words else (0,)}.get(words[1], (0,)) \
        if words[0] == "rankmem" else (0,)
    assert done.returncode in ok, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if words[:2] == ["rankmem", "advise"] and "runs/demo" in words:
        assert "no advice" in done.stdout and "barely vary" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    script = next((w for w in words if w.startswith("examples/")), None)
    if script is not None:
        _check_example(Path(script).stem, words, demo_workdir, done.stdout)


def _live_watch(argv: list[str], workdir: Path) -> None:
    """At a terminal until its first frame is drawn, then Ctrl-C: a fixed wait would stop a slow machine's
    ``rankmem watch`` before it drew anything (and on a pipe rich's live view draws only on exit)."""
    rc, text = run_at_a_terminal(argv, cwd=workdir, env=_env(), done=lambda text: "rankmem watch " in text)
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    assert "rankmem watch " in text


# ---- what each example must leave behind -------------------------------------------------------------

def _check_example(name: str, words: list[str], workdir: Path, stdout: str) -> None:
    out = _option(words, "--out")
    if out is not None:  # a run log the offline tools read
        from rankmem.offline import read_run

        run = read_run(str(workdir / out))
        assert run.steps.size >= 2 and run.world_size == int(_option(words, "--nproc-per-node") or 1)
        done = subprocess.run([sys.executable, "-m", "rankmem", "report", out], cwd=workdir, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    CHECKS.get(name, lambda *a: None)(workdir / (out or "."), stdout)


def _check_hf(out: Path, stdout: str) -> None:
    history = json.loads((out / "log_history.json").read_text())
    logged = [e for e in history if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4]
    for entry in logged:  # log_keys: only the peak RSS and the train step's peak reach the Trainer's logs
        assert sorted(k for k in entry if k.startswith("mem/")) == [
            "mem/host/peak_rss_gib/max", "mem/host/peak_rss_gib/max_rank", "mem/host/peak_rss_gib/mean",
            "mem/host/peak_rss_gib/min", "mem/host/peak_rss_gib/min_rank",
            "mem/phase/train_step/peak_rss_gib/max", "mem/phase/train_step/peak_rss_gib/max_rank"]
        assert 0.05 < entry["mem/host/peak_rss_gib/min"] <= entry["mem/host/peak_rss_gib/max"] < 8
        assert entry["mem/host/peak_rss_gib/max_rank"] in (0, 1)
        assert type(entry["mem/host/peak_rss_gib/max_rank"]) is int  # a rank, not 0.0
    # ...while the run log keeps every key, per rank.
    steps = read_log(out)[1]
    assert [rec["step"] for rec in steps] == [1, 2, 3, 4]  # every step, none for the final summary
    for rec in steps:
        for key in ("mem/host/rss_gib", "mem/host/peak_rss_gib"):
            assert len(rec["ranks"][key]) == 2 and max(rec["ranks"][key]) == rec["metrics"][key + "/max"]


def _check_lightning(out: Path, stdout: str) -> None:
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    memory = [int(r["step"]) for r in rows if r.get("mem/host/rss_gib/max")]
    loss = [int(r["step"]) for r in rows if r.get("loss")]
    assert memory == loss == [1, 3, 5, 7]  # one DDP job of 2 ranks; memory on the loss's steps
    assert len(rows) == 4  # ... and on its rows
    for r in rows:
        if r.get("mem/host/rss_gib/max"):
            assert 0.05 < float(r["mem/host/rss_gib/min"]) <= float(r["mem/host/rss_gib/max"]) < 8
            assert float(r["mem/host/rss_gib/max_rank"]) in (0, 1)
    header = json.loads((out / "rankmem.jsonl").read_text().splitlines()[0])
    assert header["world_size"] == 2


def _check_quickstart(out: Path, stdout: str) -> None:
    values = {line.split(":")[0]: line for line in stdout.splitlines()}
    assert "(rank 1)" in values["mem/host/rss_gib"]  # rank r holds (r + 1) * 64 MiB: the last rank is max


def _check_verl(out: Path, stdout: str) -> None:
    values = dict(line.split(": ") for line in stdout.strip().splitlines())
    rss_max, rss_min = float(values["mem/host/rss_gib/max"]), float(values["mem/host/rss_gib/min"])
    assert abs((rss_max - rss_min) - 0.125) < 1 / 32  # rank 1 holds 128 MiB more, within 32 MiB
    assert rss_min <= float(values["perf/cpu_memory_used_gb"]) <= rss_max
    assert float(values["actor/pg_loss"]) == 0.625  # mean of [0.5, 0.25, 1.5, 0.25]
    assert float(values["mem/phase/update/heaviest_mb_tokens/max"]) == 12  # rank 1's [3 + 4, 5]


CHECKS: dict[str, Any] = {"hf_example": _check_hf, "lightning_example": _check_lightning,
                          "quickstart": _check_quickstart, "verl_example": _check_verl}


HISTORY = re.compile(r"\bissues?\b|\bsessions?\b|\(was |\bwas \d|not lent|CI machine|so README may say", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_a_user_reads_holds_no_history(page: Path) -> None:
    """Users read what rankmem does now; how it came to be is bench/RESULTS.md's and git's."""
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert found == [], f"{page.name}: {found}"


def test_readme_is_a_short_guide() -> None:
    assert len(README.read_text().splitlines()) <= 300
    for name in re.findall(r"`docs/([a-z-]+\.md)`", README.read_text()):
        assert (REPO / "docs" / name).is_file(), f"README points at docs/{name}, which does not exist"
