"""The ``prometheus`` sink: its exposition read back with prometheus_client's own parser, the series
bound at a simulated 16,384-rank world, events by kind, and the port-in-use line."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import rankmem  # noqa: E402
from rankmem.core.catalogue import CATALOGUE  # noqa: E402
from rankmem.core.events import Event, OomEvent  # noqa: E402
from rankmem.core.records import RankInfo, RunHeader, StepRecord  # noqa: E402
from rankmem.errors import RankmemError  # noqa: E402
from rankmem.forensics.events import EventWriter  # noqa: E402
from rankmem.sinks import make_sink  # noqa: E402
from rankmem.sinks._prometheus import PrometheusSink  # noqa: E402
from tests.conftest import REPO  # noqa: E402

GIB = 2**30
MIB = 2**20


def scrape(sink: PrometheusSink) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(sink.url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def one(series: list[tuple[dict[str, str], float]], **labels: str) -> float:
    found = [v for lab, v in series if all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (labels, series)
    return found[0]


def test_a_monitor_run_reads_back_in_bytes_through_prometheus_clients_parser() -> None:
    sink = PrometheusSink(port=0, job="unit")
    monitor = rankmem.Monitor(sinks=[sink], device="cpu", children=False, leak_check=False)
    try:
        for step in range(3):
            with monitor.step(step):
                with monitor.phase("rollout"):
                    block = np.ones(64 * MIB // 8)  # 64 MiB, touched: resident inside the phase
                    block[::512] = 2.0
                del block
            out = monitor.collect({"loss": 2.0 - step})
        assert monitor.flush(10)
        got = scrape(sink)
    finally:
        monitor.close()
    assert one(got["rankmem_step"], job="unit") == 2.0
    for stat in ("max", "min", "mean"):
        assert one(got["rankmem_host_peak_rss_bytes"], stat=stat) == pytest.approx(
            out[f"mem/host/peak_rss_gib/{stat}"] * GIB, rel=1e-12)
    assert one(got["rankmem_scalar_loss"], stat="max") == 0.0
    # The phase held 64 MiB more at its peak than at its start: ground truth within 8 MiB.
    assert one(got["rankmem_phase_peak_rss_bytes"], stat="max", phase="rollout") - one(
        got["rankmem_host_rss_bytes"], stat="max") == pytest.approx(64 * MIB, abs=8 * MIB)
    assert one(got["rankmem_worst_rank"], metric="rankmem_host_peak_rss_bytes") == 0.0
    rank_series = got["rankmem_rank_host_peak_rss_bytes"]
    assert [lab["rank"] for lab, _ in rank_series] == ["0"]
    assert rank_series[0][1] == pytest.approx(out["mem/host/peak_rss_gib/max"] * GIB, rel=1e-12)
    assert one(got["rankmem_events_total"], kind="oom") == 0.0


def test_the_gpus_uuid_labels_the_per_rank_series_as_dcgm_spells_it() -> None:
    from rankmem.testing import FakeCuda

    cuda = FakeCuda()
    sink = PrometheusSink(port=0)
    monitor = rankmem.Monitor(sinks=[sink], device="cuda", device_module=cuda, children=False, leak_check=False)
    try:
        with monitor.step(0):
            handle = cuda.malloc(512 * MIB)
        monitor.collect()
        assert monitor.flush(10)
        got = scrape(sink)
        cuda.free(handle)
    finally:
        monitor.close()
    expect = "GPU-" + str(cuda.get_device_properties(0).uuid)
    assert monitor.header is not None and monitor.header.ranks[0].device_uuid == expect
    (labels, value), = got["rankmem_rank_device_peak_allocated_bytes"]
    assert labels["UUID"] == expect and labels["rank"] == "0"
    assert value == pytest.approx(512 * MIB, abs=MIB)


def _world(world: int, keys: list[str]) -> tuple[RunHeader, StepRecord, np.ndarray]:
    rng = np.random.default_rng(0)
    matrix = rng.uniform(1.0, 2.0, size=(world, len(keys)))
    ranks = [RankInfo(rank=r, local_rank=r % 8, host=f"node{r // 8}", pid=1, device="cuda:0", peak_rss_scope="window",
                      device_uuid=f"GPU-{r:08x}") for r in range(world)]
    metrics: dict[str, float] = {}
    for j, key in enumerate(keys):
        col = matrix[:, j]
        metrics.update({f"{key}/max": col.max(), f"{key}/min": col.min(), f"{key}/mean": col.mean(),
                        f"{key}/max_rank": float(col.argmax()), f"{key}/min_rank": float(col.argmin())})
        if world > 128:  # the all-reduce path's quantiles across ranks
            metrics.update({f"{key}/p{q}": float(np.percentile(col, q)) for q in (50, 90, 99)})
    record = StepRecord(7, 1.8e9, metrics, keys=keys, matrix=matrix)
    return RunHeader(world_size=world, ranks=ranks, started=1.8e9), record, matrix


KEYS_20 = [s.key for s in CATALOGUE][:20]


def test_series_at_16384_ranks_stay_under_the_stated_bound_and_name_the_worst_ranks() -> None:
    header, record, matrix = _world(16384, KEYS_20)
    sink = PrometheusSink(port=0)
    sink.open(header)
    try:
        sink.write(record)
        got = scrape(sink)
    finally:
        sink.close()
    series = sum(len(v) for v in got.values())
    bound = len(KEYS_20) * (6 + 1 + 3) + 8  # docs/prometheus.md: keys x (stats + worst + top_k) + 8
    assert series == bound, series  # every key's series is there, and no more
    assert series < 250
    assert KEYS_20[0] == "mem/host/rss_gib"
    assert one(got["rankmem_host_rss_bytes"], stat="p90") == pytest.approx(np.percentile(matrix[:, 0], 90) * GIB)
    # headroom/available: low is bad, so the worst ranks are the smallest
    for j, key in enumerate(KEYS_20):
        name = "rankmem_rank_" + key[len("mem/"):].replace("/", "_").replace("_gib", "_bytes")
        low = key in ("mem/node/available_gib", "mem/device/headroom_gib")
        expect = np.argsort(matrix[:, j] if low else -matrix[:, j], kind="stable")[:3]
        shown = got[name]
        assert [int(lab["rank"]) for lab, _ in shown] == [int(r) for r in expect], key
        assert shown[0][0]["UUID"] == f"GPU-{int(expect[0]):08x}"
        assert shown[0][0]["node"] == f"node{int(expect[0]) // 8}"
        assert shown[0][1] == pytest.approx(matrix[expect[0], j] * GIB)


def test_events_are_counted_by_kind_from_the_ranks_event_files(tmp_path: object) -> None:
    out = str(tmp_path)
    for rank, kinds in ((0, ["oom", "near_oom"]), (1, ["near_oom", "killed", "near_oom"])):
        writer = EventWriter(out, rank)
        for kind in kinds:
            assert writer.write(Event(kind=kind, step=3))
    header, record, _ = _world(2, KEYS_20[:2])
    sink = make_sink("prometheus", out, port=0)
    assert isinstance(sink, PrometheusSink)
    sink.open(header)
    try:
        sink.write(record)
        first = scrape(sink)["rankmem_events_total"]
        EventWriter(out, 1).write(OomEvent(step=4, phase="update"))
        second = scrape(sink)["rankmem_events_total"]
    finally:
        sink.close()
    assert {lab["kind"]: v for lab, v in first} == {"oom": 1, "near_oom": 3, "killed": 1, "stalled": 0}
    assert one(second, kind="oom") == 2


def test_bad_options_are_one_error_naming_the_option() -> None:
    with pytest.raises(RankmemError, match="port must be a whole number in 0..65535, got 70000"):
        make_sink("prometheus", None, port=70000)
    with pytest.raises(RankmemError, match=r"unknown option\(s\) \['prot'\] for the prometheus sink"):
        rankmem.MonitorConfig(sinks=("prometheus",), sink_options={"prometheus": {"prot": 1}})
    with pytest.raises(RankmemError, match="sink_options names the sink 'prometheus', which is not among sinks"):
        rankmem.MonitorConfig(sinks=("console",), sink_options={"prometheus": {"port": 1}})


def test_a_port_in_use_is_one_line_and_training_goes_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = textwrap.dedent(f"""
            import rankmem
            m = rankmem.Monitor(sinks=("prometheus",), sink_options={{"prometheus": {{"port": {port}}}}},
                                device="cpu", children=False)
            for s in range(5):
                with m.step(s):
                    pass
                m.collect()
            m.close()
            print("trained", s)
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained 4"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in lines[0]
    assert "Traceback" not in done.stderr


def test_ray_outside_a_ray_actor_is_a_configuration_error() -> None:
    header, _, _ = _world(2, KEYS_20[:2])
    with pytest.raises(RankmemError, match="ray=True needs the Monitor inside a Ray actor"):
        PrometheusSink(ray=True).open(header)


@pytest.mark.parametrize(("args", "line"), [
    (["--sink-option", "prometheus.port=9465"], "sink_options names the sink 'prometheus', which is not among sinks"),
    (["--sink", "prometheus", "--sink-option", "prometheus.port=x"],
     "the prometheus sink's port must be a whole number in 0..65535, got 'x'"),
    (["--sink", "prometheus", "--sink-option", "port=1"], "write NAME.KEY=VALUE"),
])
def test_bad_sink_flags_of_rankmem_train_are_one_line_exit_2(tmp_path: object, args: list[str], line: str) -> None:
    done = subprocess.run([sys.executable, "-m", "rankmem", "train", "--out", f"{tmp_path}/run", "--steps", "1",
                           *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], done.stderr
