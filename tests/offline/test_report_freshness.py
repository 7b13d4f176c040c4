"""The report's worst-key tables hold memory only: a figure's age (``mem/node/age_s``, seconds, per the
catalogue) has a line of its own, on the terminal and on the HTML page."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from tests.runlog_helpers import write_run


def test_a_freshness_figure_is_not_a_worst_memory_key(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    n = 30
    age = np.full((n, 2), 0.1)
    age[17, 1] = 2.5
    write_run(tmp_path / "run", {"mem/host/rss_gib": np.full((n, 2), 1.0), "mem/node/age_s": age})
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("mem/")]
    assert [line.split()[0] for line in table] == ["mem/host/rss_gib"], table
    assert "figures' age (mem/node/age_s): max 2.500 s at step 17 on rank 1" in out
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "run"), "--html", str(page)]) == 0
    html = page.read_text()
    assert "figures&#x27; age (mem/node/age_s): max 2.500 s at step 17 on rank 1" in html or \
        "figures' age (mem/node/age_s): max 2.500 s at step 17 on rank 1" in html
    assert "<td>mem/node/age_s</td>" not in html and "<td>mem/host/rss_gib</td>" in html
