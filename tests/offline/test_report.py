"""``rankmem report``: events, leaks and the worst rank first; per key and per phase the worst value with
its step, rank and phase; capacity and headroom; JSON; the self-contained HTML page."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.core.catalogue import key_of, phase_key
from rankmem.offline.phases import first_extreme
from rankmem.runlog import RUN_LOG_NAME
from tests.runlog_helpers import known_run, run_with_events, write_run


def test_report_names_the_rank_step_and_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = known_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The top lines: no events, the leak verdict, the worst rank of each headline key.
    assert lines[:6] == [
        "leaks: none found (4 rank series checked)",  # RSS only: no device, no workers
        "worst rss: rank 2, max 3.006 GiB at step 39",
        "worst peak_rss: rank 2, max 4.500 GiB at step 7 (phase update)",
        "worst dev_headroom: rank 1, min 0.250 GiB at step 3",
        f"run log: {path}",
        "4 ranks on 1 host, 40 logged steps (steps 0..39)",
    ]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.strip().startswith("mem/")}
    assert rows["mem/host/peak_rss_gib"][:6] == ["max", "4.500", "GiB", "7", "2", "update"]
    assert rows["mem/device/headroom_gib"] == ["min", "0.250", "GiB", "3", "1"]
    worst, value, unit, _, rank, imbalance = rows["mem/host/rss_gib"]  # no phase: RSS is a current value
    assert (worst, unit, rank) == ("max", "GiB", "2") and 3.0 < float(value) < 3.02
    assert float(imbalance) == pytest.approx(3.0 / 1.5, abs=0.02)  # max / mean of the per-rank peaks
    # Per phase: the update phase's peak is rank 2's 4.5 GiB at step 7; its mean per step is the mean of
    # each step's worst rank (rank 2: 3.25 + noise, one step at 4.5).
    phases = {(w[0], w[1]): w[2:] for w in (line.split() for line in lines) if w and w[0] in ("rollout", "update")}
    assert phases[("update", "peak_rss_gib")][:3] == ["4.500", "7", "2"]
    assert float(phases[("update", "peak_rss_gib")][3]) == pytest.approx(3.25 + 1.25 / 40, abs=0.005)
    assert phases[("rollout", "peak_rss_gib")][2] == "2"
    assert "device headroom: min 0.250 GiB at step 3 on rank 1" in lines
    assert lines[-1].startswith("host RSS growth (first to last step): ")


def _run_with_phases_and_capacity(out: Path) -> Path:
    """3 ranks, 6 steps. The update phase leaves 64 MiB behind on rank 1 every step; the device has 80 GiB,
    rank 2 comes within 1.5 GiB of it at step 4; the cgroup allows 40 GiB and rank 0's node uses 30."""
    n, w = 6, 3
    delta = np.zeros((n, w))
    delta[:, 1] = 64 / 1024
    peak = np.full((n, w), 60.0)
    peak[4, 2] = 78.5
    return write_run(out, {
        key_of("peak_reserved"): peak,
        key_of("total"): np.full((n, w), 80.0),
        key_of("headroom"): 80.0 - peak,
        phase_key("update", "peak_reserved_gib"): peak,
        phase_key("update", "rss_delta_gib"): delta,
        key_of("cgroup_limit"): np.full((n, w), 40.0),
        key_of("cgroup_used"): np.array([[30.0, 20.0, 20.0]] * n),
        key_of("node_used"): np.full((n, w), 100.0),
        key_of("node_available"): np.full((n, w), 900.0),
    })


def test_report_phase_table_capacity_and_headroom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_with_phases_and_capacity(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "capacity: device total 80.000 GiB, node total 1000.000 GiB, cgroup limit 40.000 GiB" in lines
    assert "device headroom: min 1.500 GiB at step 4 on rank 2" in lines
    assert "node available: min 900.000 GiB at step 0 on rank 0 (of 1000.000 GiB)" in lines
    assert "cgroup headroom (limit - used): min 10.000 GiB at step 0 on rank 0 (of 40.000 GiB)" in lines
    rows = [line.split() for line in lines if line.startswith("update ")]
    assert rows == [
        ["update", "peak_reserved_gib", "78.500", "4", "2", f"{(5 * 60 + 78.5) / 6:.3f}", ""][:6],
        ["update", "rss_delta_gib", "+0.062", "0", "1", "+0.062", "+0.375", "(1)"],  # 6 x 64 MiB left behind
    ]


def test_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    assert main(["report", str(tmp_path / RUN_LOG_NAME), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {k["key"]: k for k in out["keys"]}
    peak = keys["mem/host/peak_rss_gib"]
    assert (peak["value"], peak["step"], peak["rank"], peak["phase"]) == (4.5, 7, 2, "update")
    rollout_peaks = [keys["mem/host/peak_rss_gib"]["imbalance"]]
    assert rollout_peaks[0] == pytest.approx(4.5 / ((1.5 * 3 + 4.5) / 4), rel=0.01)  # max / mean of per-rank peaks
    assert keys["mem/device/headroom_gib"]["imbalance"] is None
    assert out["headroom"]["rank"] == 1 and out["leaks"] == [] and out["world_size"] == 4
    assert out["corrupt"] == 0 and out["truncated"] is False
    assert [(w["label"], w["rank"]) for w in out["worst"]] == [("rss", 2), ("peak_rss", 2), ("dev_headroom", 1)]
    update = next(p for p in out["phases"] if (p["phase"], p["key"]) == ("update", "peak_rss_gib"))
    assert (update["worst"], update["step"], update["rank"], update["total"]) == (4.5, 7, 2, None)
    assert out["limits"] == []  # known_run measures no capacity


def test_report_html_is_one_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    _run_with_phases_and_capacity(tmp_path)
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "--html", str(page)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {page}"
    text = page.read_text()
    # Opens without a network: nothing is fetched from anywhere.
    for needle in ("http://", "https://", "//cdn", "<script", "<link", "@import", "url("):
        assert needle not in text.lower(), needle
    srcs = re.findall(r'src="([^"]*)"', text)
    assert len(srcs) == 1 and srcs[0].startswith("data:image/png;base64,")
    png = base64.b64decode(srcs[0].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"matplotlib.org" not in png
    assert "<td>update</td><td>rss_delta_gib</td>" in text.replace("\n", "")
    assert "cgroup headroom (limit - used): min 10.000 GiB at step 0 on rank 0 (of 40.000 GiB)" in text
    assert main(["report", str(tmp_path), "--json", "--html", str(page)]) == 0
    json.loads(capsys.readouterr().out)  # --json keeps stdout one JSON object



def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err




@pytest.mark.parametrize("event", [
    '{"kind":"oom","rank":0,"step":1,"phase":null,"time":1.0,"device":"cuda:0"}',  # device not an object
    '{"kind":"oom","rank":0,"step":1,"phase":null,"time":1.0,"host":[1]}',  # host not an object
    '{"kind":"near_oom","rank":0,"step":1,"phase":null,"time":1.0,"reasons":7}',  # reasons not a list
])
def test_report_of_an_event_with_an_odd_field_is_not_a_traceback(tmp_path: Path, event: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """read_events keeps any JSON object with a "kind"; describe_event then calls .get() on whatever
    "device"/"host" hold and iterates "reasons": AttributeError / TypeError out of `rankmem report`
    (and `watch --once`, `report --html`), while `report --json` of the same run works."""
    run = run_with_events(tmp_path, event)
    rc, out, err = _cli(capsys, "report", str(run))
    assert rc == 0 and "EVENT" in out


@pytest.mark.parametrize("seed", range(20))
def test_the_worst_value_of_a_column_major_series_is_the_row_major_first(seed: int) -> None:
    """The reader's series are column-major; the worst value's step and rank must still be the first in
    step order (then rank order) that a row-major argmax names, NaN and infinities included."""
    rng = np.random.default_rng(seed)
    matrix = rng.integers(0, 4, size=(rng.integers(1, 40), rng.integers(1, 9))).astype(float)  # many ties
    for value in (np.nan, np.inf, -np.inf)[: seed % 4]:
        matrix.flat[rng.integers(0, matrix.size, size=2)] = value
    column_major = np.asfortranarray(matrix)
    for low in (False, True):
        expected = int(matrix.argmin() if low else matrix.argmax())
        assert first_extreme(column_major, low) == expected
        assert first_extreme(matrix, low) == expected


@pytest.mark.parametrize("written", [b"9", b"-1", b"1.5", b"1e300"])
def test_a_rank_a_line_names_outside_the_run_is_not_printed_as_a_rank(tmp_path: Path, written: bytes,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The side file gone, the worst rank comes from the lines' ``K/max_rank``: untrusted text. A digit
    damaged there (1 -> 9) must not send the user to a rank the 2-rank run never had."""
    rss = np.column_stack([np.arange(6) * 0.5, np.arange(6) * 0.5 + 1.0])  # rank 1 the worst at every step
    write_run(tmp_path, {key_of("rss"): rss}, steps=np.arange(6))
    (tmp_path / "rankmem.ranks.f64").unlink()
    log = tmp_path / RUN_LOG_NAME
    log.write_bytes(log.read_bytes().replace(b'rss_gib/max_rank":1,', b'rss_gib/max_rank":' + written + b","))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"worst rss: rank \?, max 3\.500 GiB at step 5", out) and "rank 9" not in out, out
