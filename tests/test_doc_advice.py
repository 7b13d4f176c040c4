"""Every shell command docs/advice.md shows runs as shown, in a fresh directory, in order."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO, free_port
from tests.test_readme_commands import readme_commands

DOC = REPO / "docs/advice.md"
_FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def doc_commands() -> list[str]:
    return [ln.strip() for block in _FENCE.findall(DOC.read_text()) for ln in block.splitlines() if ln.strip()]


def test_every_command_of_the_advice_page_runs(tmp_path: Path, demo_workdir: Path, once_in_demo: Any) -> None:
    """The page's ``rankmem train`` line is README's: that one launch (in the demo directory) is shared,
    and its run copied here for the page's commands after it."""
    commands = doc_commands()
    assert [c.split()[1] for c in commands] == ["train", "advise", "advise", "report"]
    env = {"OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port()), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO)}
    outputs = []
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "rankmem"
        argv = [sys.executable, "-m", "rankmem", *words[1:]]
        if command in readme_commands() and words[1] == "train":
            done = once_in_demo(argv)
            out = words[words.index("--out") + 1]
            shutil.copytree(demo_workdir / out, tmp_path / out, symlinks=True)
        else:
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        # advise answers "no advice" (a noisy or flat phase on a busy machine) with 3, and says why.
        assert done.returncode in ((0, 3) if words[1] == "advise" else (0,)), (command, done.stdout, done.stderr)
        outputs.append(done.stdout)
    assert outputs[1].startswith("capacity ")
    assert "update: " in outputs[1]
    for row in json.loads(outputs[2]):
        assert row["phase"] == "update" and row["tokens"] == 1200
        assert ("predicted_peak_gib" in row) != ("reason" in row)
