"""The prometheus sink's Ray path (issue 23): a 2-rank reference job as Ray actors on a local cluster,
its figures through ``ray.util.metrics``, read back from Ray's own metrics endpoint (the node's metrics
agent, ``_metrics_export_port``) with prometheus_client's parser: the same aggregates and worst rank
as the job's gathered metrics, and rank 1, which holds a ballast, named the worst."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO, free_port, start_ray

ray = pytest.importorskip("ray")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("opencensus") is None,
    reason="Ray's metrics agent exports nothing without Ray's default extra: pip install 'rankmem[ray-metrics]'")
BALLAST_MIB = 192
GIB = 2**30


def ballast_actor_class() -> type:
    from rankmem.ray.actor import EngineActor

    class Ballast(EngineActor):
        def build(self, job: Any, launch: dict[str, Any]) -> dict[str, Any]:
            if self.rank == 1:
                self.ballast = np.ones(BALLAST_MIB * 2**20 // 8)  # written: resident
            return super().build(job, launch)

    return Ballast


def ray_series(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("job") == "raytest":
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_ray_metrics_agent_exports_the_sinks_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankmem.engine.options import add_job_arguments, resolve_job_options
    from rankmem.ray.group import Resources, WorkerGroup

    port = free_port()
    # Ray's processes read this at start: the actors report every 0.5 s instead of every 10 s.
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    start_ray(ray, num_cpus=2, logging_level="ERROR", _metrics_export_port=port,
              runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        parser = argparse.ArgumentParser()
        add_job_arguments(parser)
        job = parser.parse_args(["--task", "sft", "--steps", "3", "--out", str(tmp_path), "--batch-size", "8",
                                 "--sink", "prometheus", "--sink-option", "prometheus.ray=true",
                                 "--sink-option", "prometheus.job=raytest"])
        resolve_job_options(job)
        group = WorkerGroup(ballast_actor_class(), 2, Resources(num_cpus=0.5))
        try:
            assert group.setup("cpu", 120) == ["cpu", "cpu"]
            group.call("build", job, {"launcher": "test"})
            for step in range(3):
                kept = group.call("step", step)[0]
            group.call("flush_telemetry", 30.0)
            got = _wait_for_step(port, 2.0, 60)
            group.call("finish")
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
    peak = {lab["stat"]: v for lab, v in got["ray_rankmem_host_peak_rss_bytes"]}
    for stat in ("max", "min", "mean"):
        assert peak[stat] == pytest.approx(kept[f"mem/host/peak_rss_gib/{stat}"] * GIB, rel=1e-12)
    assert kept["mem/host/peak_rss_gib/max_rank"] == 1  # the ballast
    (_, worst), = [s for s in got["ray_rankmem_worst_rank"] if s[0]["metric"] == "rankmem_host_peak_rss_bytes"]
    assert worst == 1.0
    ranked = {lab["rank"]: v for lab, v in got["ray_rankmem_rank_host_peak_rss_bytes"]}
    assert ranked["1"] == pytest.approx(peak["max"], rel=1e-12)
    assert ranked["1"] - ranked["0"] > (BALLAST_MIB - 48) * 2**20


def _wait_for_step(port: int, step: float, timeout: float) -> dict[str, list[tuple[dict[str, str], float]]]:
    end = time.monotonic() + timeout
    got: dict[str, list[tuple[dict[str, str], float]]] = {}
    while time.monotonic() < end:
        try:
            got = ray_series(port)
        except OSError:
            got = {}
        if any(v == step for _, v in got.get("ray_rankmem_step", [])):
            return got
        time.sleep(0.5)
    raise AssertionError(f"Ray's metrics endpoint on {port} never showed rankmem_step {step}: {sorted(got)}"
                         f" (pid {os.getpid()})")
