"""Every shell command in a fenced block of docs/*.md runs as shown (as README's do in
tests/test_readme_commands.py): ``python`` becomes this interpreter, run from the repository root."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO

_FENCE = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)


def doc_commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for block in _FENCE.findall(page.read_text(encoding="utf-8")):
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    found.append((page.name, line))
    return found


@pytest.mark.parametrize(("page", "command"), doc_commands())
def test_doc_command_runs_as_shown(page: str, command: str) -> None:
    words = shlex.split(command)
    if words[0] in ("python", "python3"):
        words = [sys.executable, *words[1:]]
    elif words[0] == "rankmem":
        words = [sys.executable, "-m", "rankmem", *words[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(words, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}: {command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr
