"""A step's peak is blamed on the phase in which memory rose to it, or on none (issue 22, item 2).

Real two-rank gloo jobs under torchrun (tests/dist_scripts/phase_rise_worker.py): one where every phase
holds a peak allocated before the first step, one where rank 1's ``update`` allocates and frees 256 MiB.
``rankmem report --json`` and its text say the same as ``rankmem train``'s summary rule and the plot's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rankmem.cli import main
from rankmem.core.catalogue import HELD, PeakPhase, peak_phase
from tests.conftest import REPO, torchrun

PHASES = {"rollout", "log_prob", "update"}
PEAKS = ("mem/host/peak_rss_gib", "mem/device/peak_allocated_gib", "mem/device/peak_reserved_gib")


def _job(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Path:
    out = tmp_path_factory.mktemp(mode)
    done = torchrun(REPO / "tests/dist_scripts/phase_rise_worker.py", 2, [str(out), mode], timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _report(out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    assert main(["report", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["report", str(out)]) == 0
    return report, capsys.readouterr().out


def test_phases_that_all_hold_the_step_peak_are_not_blamed(tmp_path_factory: pytest.TempPathFactory,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = _job(tmp_path_factory, "held")
    report, text = _report(out, capsys)
    keys = {k["key"]: k for k in report["keys"]}
    for key in PEAKS:
        k = keys[key]
        assert k["phase"] not in PHASES and k["phase_verdict"] == "held", k
        assert k["phase"] == HELD and set(k["phases"]) == PHASES  # the phases that held it, none blamed
    worst = {w["label"]: w for w in report["worst"]}
    assert worst["peak_rss"]["phase"] == HELD
    line = next(x for x in text.splitlines() if x.startswith("worst peak_rss:"))
    assert line.endswith(f"at step {worst['peak_rss']['step']} {HELD}"), line
    assert "(phase " not in line
    # The HTML page's per-key table says the same.
    page = out / "report.html"
    assert main(["report", str(out), "--html", str(page)]) == 0
    capsys.readouterr()
    html = page.read_text()
    assert html.count(HELD) >= len(PEAKS)
    # The plot's markers: grey "held" markers, no phase marker.
    import matplotlib.pyplot as plt

    from rankmem.offline import read_run
    from rankmem.offline.plot import draw_run

    fig = draw_run(read_run(str(out)), ["mem/host/peak_rss_gib"])
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert "no phase raised the step peak (held from before)" in legend
    assert not any(entry.startswith("phase ") for entry in legend)


def test_the_phase_that_allocates_and_frees_256_mib_on_rank_1_is_named(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    out = _job(tmp_path_factory, "update")
    report, text = _report(out, capsys)
    keys = {k["key"]: k for k in report["keys"]}
    for key in PEAKS:
        k = keys[key]
        assert (k["rank"], k["phase"], k["phase_verdict"], k["phases"]) == (1, "update", "rose", ["update"]), k
    from rankmem.offline import read_run

    run = read_run(str(out))
    rise = run.series["mem/phase/update/peak_rss_rise_gib"][:, 1] * 1024
    assert ((rise > 256 - 8) & (rise < 256 + 16)).all(), rise  # the 256 MiB it touched, within the probe's noise
    assert (run.series["mem/phase/rollout/peak_rss_rise_gib"][:, 1] * 1024 < 2).all()
    assert "worst peak_rss: rank 1, max" in text and "(phase update)" in text


def test_the_rule_ties_rises_within_the_noise_and_reads_old_logs() -> None:
    gib = 1 / 1024  # one MiB in GiB
    both = {"mem/phase/a/peak_rss_gib": 2.0, "mem/phase/a/peak_rss_rise_gib": 300 * gib,
            "mem/phase/b/peak_rss_gib": 2.0 - gib, "mem/phase/b/peak_rss_rise_gib": 299 * gib}
    assert peak_phase("mem/host/peak_rss_gib", 2.0, both) == PeakPhase("tie", ("a", "b"))
    one = {**both, "mem/phase/b/peak_rss_gib": 1.5}
    assert peak_phase("mem/host/peak_rss_gib", 2.0, one) == PeakPhase("rose", ("a",))
    held = {**both, "mem/phase/a/peak_rss_rise_gib": gib, "mem/phase/b/peak_rss_rise_gib": 0.0}
    assert peak_phase("mem/host/peak_rss_gib", 2.0, held) == PeakPhase("held", ("a", "b"))
    assert peak_phase("mem/host/peak_rss_gib", 2.5, both) == PeakPhase("outside")
    # A log without rise keys: phases bit-equal to the peak; two of them are a tie, not the first.
    old = {"mem/phase/a/peak_rss_gib": 2.0, "mem/phase/b/peak_rss_gib": 2.0}
    assert peak_phase("mem/host/peak_rss_gib", 2.0, old) == PeakPhase("tie", ("a", "b"))
    assert PeakPhase("tie", ("a", "b")).label == "(tie: a, b rose to it)"
