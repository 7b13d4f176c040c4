"""A real Prometheus server (the Debian package) scrapes a live 2-rank ``rankmem train`` job; its HTTP
API then gives the run log's figures back: the max of peak RSS per step, the worst rank, and the
stalled-job alert of docs/prometheus.md firing once the job has stopped (and not while it ran).

Skips, saying why, where the ``prometheus`` binary is missing (``.ci/run`` installs it where apt can).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port
from tests.runlog_helpers import read_log

pytest.importorskip("prometheus_client")
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary: apt-get install -y prometheus "
                                                           "(Debian's package; .ci/run installs it)")
DOC = REPO / "docs" / "prometheus.md"
GIB = 2**30
# The job must outlast several scrapes on a fast machine as well as a slow one: a CI machine ran 60 steps
# in about 2.5 s, which two 1 s scrapes saw. 200 steps at a scrape each 0.5 s leave a wide margin.
STEPS = 200
SCRAPE_S = "500ms"
STALE_AFTER_S = 3  # the docs' 300 s, shortened for the test


def stalled_expr() -> str:
    """The docs' RankmemJobStalled expression with its threshold cut to :data:`STALE_AFTER_S`."""
    expr = re.search(r"alert: RankmemJobStalled\n\s+expr: (.+)\n", DOC.read_text())
    assert expr is not None, "docs/prometheus.md lost its RankmemJobStalled rule"
    assert expr.group(1).endswith("> 300")
    return expr.group(1)[: -len("300")] + str(STALE_AFTER_S)


class Prom:
    """The server's HTTP API, every call with a timeout."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def raw(self, expr: str) -> dict[float, list[tuple[dict[str, str], float]]]:
        """Every sample of ``expr`` over the last 10 minutes, by scrape timestamp."""
        out: dict[float, list[tuple[dict[str, str], float]]] = {}
        for series in self.get("/api/v1/query", query=f"{expr}[10m]")["result"]:
            for t, v in series["values"]:
                out.setdefault(float(t), []).append((series["metric"], float(v)))
        return out


def start_prometheus(tmp: Path, target: int, port: int) -> subprocess.Popen[bytes]:
    config = tmp / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: {SCRAPE_S}
  evaluation_interval: {SCRAPE_S}
scrape_configs:
  - job_name: rankmem
    honor_labels: true
    scrape_timeout: {SCRAPE_S}
    static_configs:
      - targets: ["127.0.0.1:{target}"]
""")
    assert PROMETHEUS is not None
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - the server's lifetime
    return subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)


def wait_for(what: str, check: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_real_prometheus_scrapes_a_live_job_and_its_api_gives_the_run_log_back(tmp_path: Path) -> None:
    target, port = free_port(), free_port()
    server = start_prometheus(tmp_path, target, port)
    prom = Prom(port)
    try:
        wait_for("the server to be ready", prom.ready, 60)
        out = tmp_path / "run"
        job = subprocess.run([sys.executable, "-m", "rankmem", "train", "--nproc-per-node", "2", "--task", "sft",
                              "--out", str(out), "--steps", str(STEPS), "--no-progress", "--sink", "prometheus",
                              "--sink-option", f"prometheus.port={target}"],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
        assert job.returncode == 0, job.stderr[-3000:]
        stopped = time.time()
        fired = wait_for("the stalled-job alert expression", lambda: prom.get(
            "/api/v1/query", query=stalled_expr())["result"], 60)
        assert fired[0]["metric"]["job"] == "run"
        _check_scrapes_against_run_log(prom, out, stopped)
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def _check_scrapes_against_run_log(prom: Prom, out: Path, stopped: float) -> None:
    header, lines = read_log(out)
    who = {str(r["rank"]): r for r in header["ranks"]}
    by_step = {line["step"]: line["metrics"] for line in lines}
    steps = {t: s[0][1] for t, s in prom.raw('rankmem_step{job="run"}').items()}
    peaks = prom.raw('rankmem_host_peak_rss_bytes{stat="max"}')
    worst = prom.raw('rankmem_worst_rank{metric="rankmem_host_peak_rss_bytes"}')
    ranked = prom.raw("rankmem_rank_host_peak_rss_bytes")
    detail = {t: s[0][1] for t, s in prom.raw("rankmem_rank_detail_step").items()}
    assert len(set(steps.values())) >= 3, f"too few scrapes of the job: {steps}"
    for t, step in steps.items():
        logged = by_step[int(step)]
        (_, peak), = peaks[t]
        assert peak == pytest.approx(logged["mem/host/peak_rss_gib/max"] * GIB, rel=1e-9, abs=1.0), step
        (_, rank), = worst[t]
        assert rank == logged["mem/host/peak_rss_gib/max_rank"], step
        # The per-rank series come from the collect with detail: at 2 ranks, every collect.
        assert detail[t] == step
        top = max(ranked[t], key=lambda s: s[1])
        assert top[0]["rank"] == str(int(logged["mem/host/peak_rss_gib/max_rank"]))
        for labels, _ in ranked[t]:  # each series names its rank's node and local rank, as the header does
            assert (labels["node"], labels["local_rank"]) == (who[labels["rank"]]["host"],
                                                              str(who[labels["rank"]]["local_rank"]))
    # While the job ran, the stalled expression was quiet: evaluated at its last scrape.
    last_scrape = max(steps)
    assert last_scrape < stopped
    assert prom.get("/api/v1/query", query=stalled_expr(), time=str(last_scrape))["result"] == []
