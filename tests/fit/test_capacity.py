"""One capacity and one verdict: ``rankmem advise``, ``report`` (text and ``--json``), the HTML page,
``watch --once --json`` and the online warning of one real run (2 gloo ranks under torchrun, each
phase touching 64 KiB per token told) give the same capacity per rank and the same verdict."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from rankmem.cli import main
from tests.conftest import REPO, torchrun
from tests.dist_scripts.one_owner_worker import STEPS, tokens

WARMUP = 2  # advise's default, the report's and the online watch's


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one_owner")
    proc = torchrun(REPO / "tests/dist_scripts/one_owner_worker.py", 2, [str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _out(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_advise_report_html_watch_and_the_online_warning_agree(run: Path, capsys, tmp_path: Path) -> None:
    online = json.loads((run / "online.json").read_text())
    limit, (verdict,) = online["limit"], online["verdicts"]
    # Ground truth the worker made: the verdict's heaviest micro-batch is the most its rank told after
    # warm-up.
    assert verdict["tokens"] == max(tokens(verdict["rank"], s) for s in range(WARMUP, STEPS))
    assert verdict["fits"] is True and verdict["high_gib"] < limit["usable"]  # ~0.1 GiB on a node of GiBs
    capacity = (f"capacity {limit['capacity']:.3f} GiB per rank ({limit['source']}), headroom "
                f"{limit['headroom']:.3f} GiB: usable {limit['usable']:.3f} GiB")
    said = (f"update: fits: fitted peak at its heaviest micro-batch seen ({verdict['tokens']:.0f} tokens, "
            f"rank {verdict['rank']}) {verdict['high_gib']:.3f} GiB of usable {limit['usable']:.3f}")

    advise = _out(capsys, "advise", str(run)).splitlines()
    assert advise[0].startswith(capacity + " against ") and f"  {said}" in advise
    rows = json.loads(_out(capsys, "advise", str(run), "--json"))
    assert {r["fits"] for r in rows} == {True}

    report = _out(capsys, "report", str(run)).splitlines()
    assert capacity in report and f"  {said}" in report
    assert json.loads(_out(capsys, "report", str(run), "--json"))["advice"] == online

    page = tmp_path / "page.html"
    _out(capsys, "report", str(run), "--html", str(page))
    text = html.unescape(page.read_text())
    assert capacity in text and said in text

    frame = json.loads(_out(capsys, "watch", str(run), "--once", "--json"))
    assert frame["advice"] == online


def test_the_host_limit_is_the_tightest_of_cgroup_and_node_less_their_other_processes() -> None:
    """Two ranks on one node: RSS 1 GiB each. The cgroup (8 GiB) holds 0.5 GiB besides them: 3.75 GiB a
    rank. The node (16 GiB) holds 9 GiB of others (another job): 3.5 GiB a rank, the tighter."""
    import numpy as np

    from rankmem.core.catalogue import key_of, work_key
    from rankmem.fit.capacity import assess

    ones = np.ones((6, 2))
    series = {key_of("rss"): ones, key_of("cgroup_limit"): 8 * ones, key_of("cgroup_working_set"): 2.5 * ones,
              key_of("node_used"): 11 * ones, key_of("node_available"): 5 * ones,
              work_key("update", "mb_tokens"): 100 * ones}  # told its tokens, its peaks not measured
    found = assess(series, np.arange(6), ["n", "n"], WARMUP)
    assert found.limit is not None and found.limit.capacity == pytest.approx(3.5)
    assert found.limit.source == "node total less 9.000 GiB of other processes / 2 ranks"
    assert found.lines()[1] == ("  update: no verdict: the run has no mem/phase/update/peak_rss_gib: "
                                "it did not measure it")
    series[key_of("node_used")], series[key_of("node_available")] = 3 * ones, 13 * ones  # 1 GiB of others:
    # 7.5 GiB a rank on the node; the cgroup's 3.75 binds
    tighter = assess(series, np.arange(6), ["n", "n"], WARMUP).limit
    assert tighter is not None and tighter.capacity == pytest.approx(3.75)
