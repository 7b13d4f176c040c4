"""Every shell command docs/prometheus.md shows runs as shown, in a fresh directory holding the files the
page saves (``<!-- file: NAME -->`` before a block): ``rankmem train`` (this interpreter's, on a free
port instead of the page's 9465) and ``promtool``, which checks the page's scrape config and alert
rules (skipped, saying why, where Debian's prometheus package is missing)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.runlog_helpers import read_log

pytest.importorskip("prometheus_client")
DOC = REPO / "docs" / "prometheus.md"
_FENCE = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
_FILE = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)
PAGE_PORT = "9465"


def doc_commands() -> list[str]:
    found = []
    for block in _FENCE.findall(DOC.read_text()):
        found += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return found


def test_the_page_shows_the_commands_this_test_runs() -> None:
    kinds = [shlex.split(c)[:2] for c in doc_commands()]
    assert kinds == [["rankmem", "train"], ["promtool", "check"], ["promtool", "check"]], kinds


@pytest.fixture
def page_dir(tmp_path: Path) -> Path:
    for name, text in _FILE.findall(DOC.read_text()):
        (tmp_path / name).write_text(text)
    assert (tmp_path / "prometheus.yml").exists() and (tmp_path / "rankmem-rules.yml").exists()
    return tmp_path


def test_the_pages_rankmem_train_line_runs_with_the_sink(page_dir: Path) -> None:
    line = next(c for c in doc_commands() if c.startswith("rankmem train"))
    port = str(free_port())
    argv = [sys.executable, "-m", "rankmem", *[a.replace(PAGE_PORT, port) for a in shlex.split(line)[1:]]]
    done = subprocess.run(argv, cwd=page_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    header, lines = read_log(page_dir / "runs" / "prom")
    assert header["config"]["sinks"] == ["jsonl", "prometheus"]
    assert header["config"]["sink_options"] == {"prometheus": {"port": int(port)}}
    assert len(lines) == 20
    assert "in use" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="no promtool: apt-get install -y prometheus (Debian's package; .ci/run installs it)")
def test_the_pages_promtool_lines_pass_on_its_config_and_rules(page_dir: Path) -> None:
    lines = [c for c in doc_commands() if c.startswith("promtool")]
    for line in lines:
        done = subprocess.run(shlex.split(line), cwd=page_dir, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert "SUCCESS" in done.stdout + done.stderr, line
    rules = subprocess.run(["promtool", "check", "rules", "rankmem-rules.yml"], cwd=page_dir, capture_output=True,
                           text=True, timeout=60)
    assert "2 rules found" in rules.stdout
