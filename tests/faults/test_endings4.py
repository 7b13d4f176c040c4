"""Endings as users see them: ``rankmem watch`` off a terminal (``> file``) prints each frame whole and
flushed, so a SIGTERM loses nothing already drawn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.runlog_helpers import known_run


def test_watch_into_a_file_keeps_every_frame_drawn_before_sigterm(tmp_path: Path) -> None:
    run = known_run(tmp_path / "run").parent
    out = tmp_path / "frames.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "rankmem", "watch", str(run), "--interval", "0.2"],
                                stdout=sink, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            deadline = time.monotonic() + 60
            while out.read_text().count("rankmem watch ") < 3:  # three frames drawn, to the file
                assert proc.poll() is None and time.monotonic() < deadline, "watch drew no 3 frames in 60 s"
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    text = out.read_text()
    frames = text.split("rankmem watch ")[1:]
    assert len(frames) >= 3
    # Every frame whole: the same lines as the first (the log does not change), the last one included.
    assert len({f.count("\n") for f in frames}) == 1, [f.count("\n") for f in frames]
    assert f"{run} · 4 ranks" in frames[0]
