"""Text that cannot break the exporter: a run directory whose name is not UTF-8 (the job label) and a
caller's key holding such bytes (a HELP line, a name) are escaped where the sink makes them; every
scrape answers 200 and parses, and the job's stderr stays empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("prometheus_client")

JOB = r"""
import os, sys, urllib.request
import rankmem
from prometheus_client.parser import text_string_to_metric_families
from rankmem.sinks._prometheus import PrometheusSink

out = os.fsdecode(os.fsencode(sys.argv[1]) + b"/run-\xff\xfe")  # surrogate escapes, as os.listdir gives them
sink = PrometheusSink(port=0, out_dir=out)
monitor = rankmem.Monitor(sinks=[sink], device="cpu", children=False, leak_check=False)
key = os.fsdecode(b"loss-\xe9")
for step in range(3):
    with monitor.step(step), monitor.phase("update"):
        pass
    monitor.collect({key: 1.0 + step})
    assert monitor.flush(10)
    with urllib.request.urlopen(sink.url, timeout=10) as response:
        assert response.status == 200, response.status
        text = response.read().decode("utf-8")  # strict: the exposition is UTF-8
    names = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    jobs = {s.labels.get("job") for s in names.values()}
    print(step, " ".join(sorted(jobs)), " ".join(n for n in names if n.startswith("rankmem_scalar_loss")))
monitor.close()
"""


def test_text_that_is_not_utf8_leaves_every_scrape_200_and_stderr_empty(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    # The job label keeps the bytes, escaped; the scalar's name is sanitised to one family.
    assert all(r"run-\udcff\udcfe" in line and "rankmem_scalar_loss__" in line for line in lines), lines
