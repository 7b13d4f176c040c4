"""``rankmem plot``: a PNG of the asked size next to the run log by default, capacity as a line, a y range
that shows drift at its size, phase peaks per rank in the rank's colour; clear errors."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.core.catalogue import key_of, phase_key
from rankmem.offline.plot import MARK_GAP_PX, MARKS_PER_RANK
from tests.runlog_helpers import known_run, write_run


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_plot_writes_png_of_the_asked_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    out = tmp_path / "mem.png"
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (mem/host/rss_gib, mem/host/peak_rss_gib)\n"
    assert _png_size(out) == (1200, 720)  # 360 px per default key present
    assert main(["plot", str(tmp_path), "-o", str(out), "--keys", "mem/device/headroom_gib", "--size", "800x500"]) == 0
    assert _png_size(out) == (800, 500)
    capsys.readouterr()
    assert main(["plot", str(tmp_path), "-o", str(out), "--keys", "mem/nope"]) == 2
    assert capsys.readouterr().err == (
        "rankmem plot: error: no such key(s) in the run log: mem/nope; choose from: "
        "mem/device/headroom_gib, mem/host/peak_rss_gib, mem/host/rss_gib\n"
    )


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    known_run(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "rankmem plot: error: rankmem plot needs matplotlib, which is not installed: pip install 'rankmem[plot]'\n"
    )


def test_plot_marks_events_at_their_step(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    import rankmem
    from rankmem.offline import read_run
    from rankmem.offline.plot import draw_run

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    for step in range(5):
        try:
            with monitor.step(step):
                if step == 3:
                    raise MemoryError("simulated")
        except MemoryError:
            pass
        monitor.collect()
    monitor.close()
    fig = draw_run(read_run(str(tmp_path)), ["mem/host/rss_gib"])
    try:
        ax = fig.axes[0]
        marks = [line for line in ax.get_lines() if line.get_label() == "oom rank 0"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [3, 3]
        assert "oom rank 0" in [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        plt.close(fig)


def _figure(tmp_path: Path, series: dict[str, np.ndarray], keys: list[str]) -> Any:
    from rankmem.offline import read_run
    from rankmem.offline.plot import draw_run

    write_run(tmp_path, series)
    return draw_run(read_run(str(tmp_path)), keys)


def test_capacity_is_a_line_with_its_legend_entry(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    n, w = 8, 2
    peak = np.full((n, w), 60.0)
    peak[5, 1] = 78.5  # 1.5 GiB short of the device
    rss = np.full((n, w), 20.0)
    fig = _figure(tmp_path, {key_of("peak_reserved"): peak, key_of("total"): np.full((n, w), 80.0),
                             key_of("rss"): rss, key_of("node_used"): np.full((n, w), 100.0),
                             key_of("node_available"): np.full((n, w), 900.0)},
                  [key_of("peak_reserved"), key_of("rss")])
    try:
        device, host = fig.axes
        (line,) = [ln for ln in device.get_lines() if ln.get_label() == "device total 80.000 GiB"]
        assert list(line.get_ydata()) == [80.0] * n and list(line.get_xdata()) == list(range(n))
        assert "device total 80.000 GiB" in [t.get_text() for t in device.get_legend().get_texts()]
        assert device.get_ylim() == pytest.approx((0.0, 84.0))  # from 0 to just above the capacity
        # 1000 GiB over a 20 GiB RSS would flatten it: the line stays off the panel and says so.
        label = "node total 1000.000 GiB (off the panel: peak is 2.0%)"
        assert [ln.get_label() for ln in host.get_lines() if ln.get_label().startswith("node total")] == [label]
        assert label in [t.get_text() for t in host.get_legend().get_texts()]
        assert host.get_ylim()[1] < 100
    finally:
        plt.close(fig)


def test_drift_of_a_few_mib_is_not_a_staircase(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    rss = 20.0 + np.linspace(0, 12 / 1024, 50)[:, None] * np.ones((1, 2))  # 12 MiB over the run
    fig = _figure(tmp_path, {key_of("rss"): rss}, [key_of("rss")])
    try:
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        assert high - low >= 0.25  # the floor: 12 MiB is a twentieth of the panel, not all of it
        assert low < 20.0 and high > 20.0 + 12 / 1024
        assert [t.get_text() for t in ax.texts] == ["data range 20.000..20.012 GiB (12.0 MiB)"]
    finally:
        plt.close(fig)


def test_phase_peaks_sit_on_each_rank_in_its_colour(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    n, w = 400, 2
    rollout = np.full((n, w), 2.0) + np.arange(w)
    update = rollout - 0.5
    update[100:110, 1] = 9.0  # rank 1's update sets its peak on steps 100..109
    peak = np.maximum(rollout, update)
    fig = _figure(tmp_path, {key_of("peak_rss"): peak, phase_key("rollout", "peak_rss_gib"): rollout,
                             phase_key("update", "peak_rss_gib"): update}, [key_of("peak_rss")])
    try:
        ax = fig.axes[0]
        colors = {ln.get_label().split(" (")[0]: ln.get_color() for ln in ax.get_lines()}
        marks = [c for c in ax.collections if len(c.get_offsets())]
        by_rank = {}
        for c in marks:
            rank = next(r for r in range(w) if np.allclose(c.get_facecolor()[0], matplotlib_rgba(colors[f"rank {r}"])))
            by_rank.setdefault(rank, []).append(c)
        assert sorted(by_rank) == [0, 1]
        update_marks = [c for c in by_rank[1] if c.get_offsets()[:, 1].max() == 9.0]
        marked = sorted(update_marks[0].get_offsets()[:, 0])
        assert len(marked) >= 2 and set(marked) <= set(range(100, 110)) and marked[0] == 100
        assert all(len(c.get_offsets()) <= MARKS_PER_RANK for c in marks)  # legible at 400 steps
        fig.canvas.draw()
        for rank, collections in by_rank.items():  # no two marks of a rank closer than MARK_GAP_PX: no bar
            xs = np.sort(np.concatenate([ax.transData.transform(c.get_offsets())[:, 0] for c in collections]))
            assert np.diff(xs).min() >= MARK_GAP_PX * 0.75, (rank, np.diff(xs).min())
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "phase rollout raised the step peak (in the rank's colour)" in legend
        assert "phase update raised the step peak (in the rank's colour)" in legend
    finally:
        plt.close(fig)


def test_the_legend_covers_no_data_point(tmp_path: Path) -> None:
    """Through the figure's artists: each panel's legend box, in display pixels, holds no point of any
    line or mark (the old legend at "best" sat on rank 1's data)."""
    import matplotlib.pyplot as plt

    n, w = 400, 4
    rng = np.random.default_rng(3)
    rss = 1.0 + np.cumsum(rng.normal(0, 0.01, (n, w)), axis=0) + np.arange(w) * 0.2
    rollout, update = rss + 0.3, rss + 0.1
    update[::37, 1] += 1.0
    fig = _figure(tmp_path, {key_of("rss"): rss, key_of("peak_rss"): np.maximum(rollout, update),
                             phase_key("rollout", "peak_rss_gib"): rollout, phase_key("update",
                                                                                      "peak_rss_gib"): update},
                  [key_of("rss"), key_of("peak_rss")])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            box = ax.get_legend().get_window_extent(renderer)
            points = [ax.transData.transform(np.column_stack(ln.get_data())) for ln in ax.get_lines()]
            points += [ax.transData.transform(c.get_offsets()) for c in ax.collections if len(c.get_offsets())]
            xy = np.concatenate(points)
            inside = (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)
            assert not inside.any(), (ax.get_title(), xy[inside][:3])
            assert box.x1 <= fig.bbox.width + 1  # and inside the image

    finally:
        plt.close(fig)


def matplotlib_rgba(color: Any) -> Any:
    from matplotlib.colors import to_rgba

    return to_rgba(color)


def test_plot_defaults_to_the_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_run(tmp_path)
    assert main(["plot", str(tmp_path / "rankmem.jsonl")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'rankmem.png'} (")
    assert _png_size(tmp_path / "rankmem.png") == (1200, 720)



def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plot_of_a_value_near_float_max_is_one_error_line_not_a_traceback(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A per-rank value of 1.7e308 (finite, "huge") makes the y range overflow to inf; matplotlib's
    ValueError("Axis limits cannot be NaN or Inf") escapes the CLI as a traceback."""
    rss = np.full((10, 2), 1.0)
    rss[4, 1] = 1.7e308
    write_run(tmp_path, {"mem/host/rss_gib": rss})
    rc, out, err = _cli(capsys, "plot", str(tmp_path))
    assert rc == 2 and err.startswith("rankmem plot: error: cannot draw ") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "rankmem.png").exists()
