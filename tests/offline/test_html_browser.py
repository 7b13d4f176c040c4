"""``report --html`` rendered in a real browser (headless Chromium, the system package): the DOM it
builds has the header card with the verdict first, the events next, the tables with column help and
a plot per key family; a screenshot comes back at the window's size. Skipped, with the reason, where
no Chromium can be had (``.ci/run`` installs it where apt can)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.core.catalogue import key_of
from rankmem.core.events import NearOomEvent
from rankmem.forensics.events import EventWriter
from tests.runlog_helpers import write_run

pytest.importorskip("matplotlib")
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium here (apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--no-first-run", "--disable-extensions"]


def _page(tmp_path: Path) -> Path:
    n, w = 30, 2
    rss = np.linspace(1.0, 1.2, n)[:, None] + np.array([0.0, 0.5])
    write_run(tmp_path, {key_of("rss"): rss, key_of("peak_rss"): rss + 0.1,
                         key_of("peak_reserved"): np.full((n, w), 3.0) + np.array([0.0, 1.0]),
                         key_of("total"): np.full((n, w), 8.0)})
    EventWriter(str(tmp_path), 1).write(NearOomEvent(rank=1, step=12, phase="update",
                                                     reasons=("device headroom 0.4 GiB",), time=1.7e9 + 12))
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "--html", str(page)]) == 0
    return page


def _browser(*args: str) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    return subprocess.run([BROWSER, *FLAGS, *args], capture_output=True, text=True, timeout=120)


def test_the_page_in_chromium_has_the_card_events_first_and_a_plot_per_family(tmp_path: Path) -> None:
    page = _page(tmp_path)
    done = _browser("--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    sections = re.findall(r'<section id="([a-z]+)"', dom)
    assert sections[:3] == ["summary", "events", "findings"] and sections[-1] == "plots", sections
    assert 'data-verdict="events"' in dom and '<span class="verdict events">events</span>' in dom
    for label in ("ranks", "hosts", "steps", "duration", "started", "last step logged", "job", "versions"):
        assert f"<dt>{label}</dt>" in dom, label
    assert "<dt>ranks</dt><dd>2</dd>" in dom and "<dt>hosts</dt><dd>node0</dd>" in dom
    assert "<dt>duration</dt><dd>29.0 s</dd>" in dom  # 30 collects a second apart, from the header's start
    events = dom[dom.index('<section id="events"'):dom.index('<section id="findings"')]
    assert "near_oom rank 1 step 12 phase update" in events
    assert re.search(r'<th class="right" title="the worst rank\'s value over the mean[^"]*">max/mean</th>', dom)
    assert "<summary>What the columns mean</summary>" in dom
    assert re.findall(r'<figure data-family="([^"]+)">', dom) == ["mem/host", "mem/device"]
    assert dom.count('src="data:image/png;base64,') == 2


@pytest.mark.parametrize("width,height", [(1280, 900), (420, 800)])
def test_a_screenshot_comes_back_at_the_windows_size(tmp_path: Path, width: int, height: int) -> None:
    page = _page(tmp_path)
    shot = tmp_path / "shot.png"
    done = _browser(f"--screenshot={shot}", f"--window-size={width},{height}", page.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (width, height)
    assert len(data) > 10_000  # a drawn page, not a blank one
