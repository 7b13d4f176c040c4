"""docs/device-attribution.md: every command in its fenced blocks runs as shown, and its key table names
exactly the catalogue's device-attribution keys."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from rankmem.core.catalogue import ATTRIBUTION_FIELDS, key_of
from tests.conftest import REPO

DOC = REPO / "docs" / "device-attribution.md"


def _commands() -> list[str]:
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", DOC.read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_every_command_runs_as_shown() -> None:
    commands = _commands()
    assert commands == ["rankmem doctor"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "rankmem"
        proc = subprocess.run([sys.executable, "-m", "rankmem", *argv[1:]], capture_output=True, text=True,
                              timeout=180, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stdout.splitlines() if line.startswith("device attribution")]
        # The two lines the page promises, each saying what holds here (this machine has no CUDA device).
        assert [line.split(":")[0] for line in lines] == ["device attribution PID join", "device attribution"]


def test_the_key_table_holds_the_catalogue_keys() -> None:
    rows = "\n".join(line for line in DOC.read_text().splitlines() if line.startswith("| "))
    named = set(re.findall(r"`(mem/device/[a-z_]+_gib)`", rows))
    assert named == {key_of(f) for f in ATTRIBUTION_FIELDS} | {key_of("reserved")}
