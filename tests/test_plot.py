"""``rankmem plot``: a PNG of the asked size, clear errors for unknown keys and a missing extra."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from rankmem.cli import main
from tests.runlog_helpers import known_run


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
    from rankmem.plot import draw_run
    from rankmem.runlog import read_run

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
