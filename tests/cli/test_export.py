"""``rankmem export RUN --parquet OUT``: the side file's per-rank values as one Parquet table; without the
``parquet`` extra, one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.runlog_helpers import KNOWN_STEPS, KNOWN_WORLD, known_run


def test_export_writes_every_ranks_values_as_a_table(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    from rankmem.cli import main
    from rankmem.offline import read_run

    known_run(tmp_path / "run")
    out = tmp_path / "ranks.parquet"
    assert main(["export", str(tmp_path / "run"), "--parquet", str(out)]) == 0
    table = pq.read_table(out).to_pydict()
    run = read_run(str(tmp_path / "run"))
    assert len(table["step"]) == KNOWN_STEPS * KNOWN_WORLD
    assert table["rank"][:KNOWN_WORLD] == list(range(KNOWN_WORLD)) and table["step"][KNOWN_WORLD] == 1
    rss = np.array(table["mem/host/rss_gib"]).reshape(KNOWN_STEPS, KNOWN_WORLD)
    np.testing.assert_array_equal(rss, run.series["mem/host/rss_gib"])
    assert table["mem/phase/update/peak_rss_gib"][7 * KNOWN_WORLD + 2] == 4.5  # known_run's rank 2, step 7


def test_export_without_the_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    known_run(tmp_path / "run")
    code = ("import sys; sys.modules['pyarrow'] = None; from rankmem.cli import main; "
            f"sys.exit(main(['export', {str(tmp_path / 'run')!r}, '--parquet', {str(tmp_path / 'x.parquet')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("rankmem export: error: rankmem export --parquet needs pyarrow, which is not installed: "
                           "pip install 'rankmem[parquet]'\n")
    assert not (tmp_path / "x.parquet").exists()
