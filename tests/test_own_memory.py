"""rankmem's own host memory stays out of the verdicts (issue 22, item 3): in a 2-rank job whose ranks do
identical work, the logging rank, which writes the run log, is within 4 MiB of the other, and what
rankmem does on it is never booked to a user phase. The columnar side file is written by a writer
process (rankmem.runlog.detail_pipe), so pyarrow never enters the rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, torchrun

MIB = 1 << 20
WORKER = REPO / "tests/dist_scripts/symmetric_rss_worker.py"


def _ranks(out: Path) -> list[tuple[int, bool]]:
    values = [(out / f"rank{r}.rss").read_text().split() for r in range(2)]
    return [(int(rss), loaded == "1") for rss, loaded in values]


@pytest.fixture(scope="module")
def runlog_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("symmetric")
    done = torchrun(WORKER, 2, [str(out), "runlog"], timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_logging_rank_is_within_4_mib_of_the_other_with_the_run_log_on(runlog_job: Path) -> None:
    (rss0, arrow0), (rss1, arrow1) = _ranks(runlog_job)
    assert abs(rss0 - rss1) < 4 * MIB, f"rank 0 - rank 1 = {(rss0 - rss1) / MIB:+.1f} MiB"
    assert not arrow0 and not arrow1  # the side file's writer holds pyarrow, in its own process


def test_the_side_file_still_holds_every_ranks_values(runlog_job: Path) -> None:
    from rankmem.offline import read_run

    run = read_run(str(runlog_job / "run"))
    assert run.logged is None and run.detail_note is None  # every step's per-rank values, from the side file
    assert run.steps.tolist() == list(range(30))
    assert run.series["loss"].tolist() == [[1.0, 1.0]] * 30
    rss = run.series["mem/host/rss_gib"]
    assert np.isfinite(rss).all() and (rss > 0.05).all()


def test_rankmems_own_work_is_not_booked_to_the_users_phase(runlog_job: Path) -> None:
    from rankmem.offline import read_run

    run = read_run(str(runlog_job / "run"))
    # Both ranks run the same phase; what the logging rank's phase grows beyond the other's would be
    # rankmem's (its writer thread runs meanwhile). Within 1 MiB at every step, the first included.
    for key in ("mem/phase/update/peak_rss_rise_gib", "mem/phase/update/rss_delta_gib"):
        m = run.series[key] * 1024
        assert np.abs(m[:, 0] - m[:, 1]).max() < 1.0, (key, m.round(2).tolist())
