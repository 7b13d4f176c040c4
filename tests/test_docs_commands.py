"""Every shell block in docs/*.md runs as shown, in a scratch directory holding one run under
runs/demo, ``bench/`` and ``examples/`` (and HOME pointed there, for the completion install).

``rankmem train`` runs at most ``TRAIN_STEPS`` steps, as README's commands do (``make demo``'s 400 take
minutes; the short run exercises the same options).

Pages whose commands need a job of their own or an outside server have a test of their own, which runs
their blocks against what they need: :data:`OWN_TESTS`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROCESS_TIMEOUT_S, REPO, command_env, train_steps_cap
from tests.runlog_helpers import known_run

_FENCE = re.compile(r"```bash\n(.*?)```", re.S)
OWN_TESTS = {"advice.md": "tests/test_doc_advice.py", "prometheus.md": "tests/sinks/test_prometheus_docs.py",
             "device-attribution.md": "tests/test_docs_device_attribution.py"}
DOCS = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in OWN_TESTS]
# A block runs as one script: its lines share a shell (a mkdir, then a write into it).
COMMANDS = [(page.name, block.strip()) for page in DOCS for block in _FENCE.findall(page.read_text())]


def capped(block: str) -> str:
    """``block`` with each ``rankmem train`` line given at most ``TRAIN_STEPS`` steps."""
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("rankmem train "):
            command, hash_, comment = line.partition(" #")
            lines[i] = " ".join([command.rstrip(), *train_steps_cap(shlex.split(command))]) + hash_ + comment
    return "\n".join(lines)


def test_every_page_with_its_own_test_has_that_test() -> None:
    for page, test in OWN_TESTS.items():
        assert (REPO / "docs" / page).is_file() and (REPO / test).is_file(), (page, test)


def test_the_docs_have_commands() -> None:
    assert any(c.startswith("rankmem report") for _, c in COMMANDS) and len(COMMANDS) >= 4


@pytest.mark.parametrize("page,command", COMMANDS)
def test_docs_command_runs_as_shown(tmp_path: Path, page: str, command: str) -> None:
    pytest.importorskip("matplotlib")
    if re.search(r"--nnodes[ =](?!1\b)\d", command):
        pytest.skip("several nodes: tests/engine/test_engine.py forms a two-agent job on one machine")
    known_run(tmp_path / "runs" / "demo")
    for tree in ("bench", "examples"):
        (tmp_path / tree).symlink_to(REPO / tree)
    # `rankmem` is the venv's entry point; PYTHONPATH puts this checkout first, as for every test.
    env = {**command_env(), "HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", capped(command)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, f"{page}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr
    if "completion bash >" in command:
        assert (tmp_path / ".local/share/bash-completion/completions/rankmem").read_text().startswith("# bash "
                                                                                                      "completion")
