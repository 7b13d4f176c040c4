"""The reference worker on Ray: ``rankmem train --launcher ray`` end to end, a killed actor, the worst
rank in the driver's kept metrics, Ray's processes out of the children figure, and bad input.

A Ray cluster costs seconds to start on a loaded 2-core machine, so three tests start one (two CLI
launches and one in-process driver that shares its cluster between several checks); the rest need
none. Every launch has a timeout; after each, no process of its cluster may be left: every process a
launch starts (gcs_server, raylet, Ray's helpers, the actors) inherits a marker in its environment,
and the test looks for it in every process on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from rankmem.cli import main
from tests.conftest import REPO, free_port, start_ray
from tests.runlog_helpers import read_log

ray = pytest.importorskip("ray")

LAUNCH_TIMEOUT_S = 240
MARK = "RANKMEM_TEST_RAY_MARK"


def launch(out: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``rankmem train --launcher ray`` in a subprocess whose every descendant carries a fresh marker."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), MARK: mark}
    cmd = [sys.executable, "-m", "rankmem", "train", "--launcher", "ray", "--no-progress", "--out", str(out), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), mark


def marked(mark: str) -> list[str]:
    """Processes still alive that a launch with ``mark`` started."""
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {p.info['name']}")
        except psutil.Error:
            continue
    return found


def assert_nothing_left(mark: str) -> None:
    deadline = time.monotonic() + 10  # ray.shutdown returns as the processes get their signals
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked(mark) == []


def test_ray_launch_trains_logs_and_leaves_no_process(tmp_path: Path) -> None:
    started = time.monotonic()
    proc, mark = launch(tmp_path, "--nproc-per-node", "2", "--task", "grpo", "--steps", "20")
    out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    print(f"ray launch, 20 grpo steps: {time.monotonic() - started:.1f} s")
    assert_nothing_left(mark)

    header, steps = read_log(tmp_path)
    assert header["world_size"] == 2 and [r["rank"] for r in header["ranks"]] == [0, 1]
    # Two actors on one node: one host, local ranks 0 and 1, two processes; rankmem report says so.
    assert len({r["host"] for r in header["ranks"]}) == 1 and [r["local_rank"] for r in header["ranks"]] == [0, 1]
    assert len({r["pid"] for r in header["ranks"]}) == 2
    assert header["config"]["run"]["launch"] == {"launcher": "ray", "ray_address": "local", "nodes": 1,
                                                  "cpus_per_actor": 1.0, "gpus_per_actor": 0.0}
    assert [s["step"] for s in steps] == list(range(20))
    reward = [s["metrics"]["reward/mean"] for s in steps]
    assert np.mean(reward[-5:]) > np.mean(reward[:5]), reward
    last = steps[-1]
    for phase in ("rollout", "log_prob", "update"):
        assert len(last["ranks"][f"mem/phase/{phase}/peak_rss_gib"]) == 2
    for key in ("mem/host/rss_gib", "mem/node/used_gib", "loss"):
        vec = last["ranks"][key]
        assert len(vec) == 2 and last["metrics"][key + "/max"] == max(vec)
        assert int(last["metrics"][key + "/max_rank"]) == vec.index(max(vec))
    # Node figures are the node's, read by each rank: equal up to what changed between two reads.
    assert abs(np.subtract(*last["ranks"]["mem/node/used_gib"])) < 0.5
    # Actors have no Ray helper below them: the children figure is 0, not Ray's processes.
    assert last["ranks"]["mem/host/children_rss_gib"] == [0.0, 0.0]

    # The summary is the torchrun path's, its peak the one `rankmem report` names.
    from rankmem.offline import read_run
    from rankmem.offline.report import build_report

    peak = next(k for k in build_report(read_run(str(tmp_path / "rankmem.jsonl"))).keys
                if k.key == "mem/host/peak_rss_gib")
    lines = out.splitlines()
    assert lines[0].startswith("ray: a local cluster for this job, logs in /")
    assert "rankmem train: grpo/ddp, 2 ranks, 20 steps, 0.34M params, device cpu" in lines
    assert "ray: 2 actors on 1 node (2 per node), 1 CPU and 0 GPU each" in lines
    assert [line.split() for line in lines if line.startswith("  mem/host/peak_rss_gib ")] == [
        ["mem/host/peak_rss_gib", "max", f"{peak.value:.3f}", "GiB", "rank", str(peak.rank), "step", str(peak.step),
         # A phase that raised the peak is named; a held or tied peak is said so, in parentheses.
         *(str(peak.phase).split() if str(peak.phase).startswith("(") else ["phase", str(peak.phase)])]]
    assert lines[-1] == f"run log: {tmp_path / 'rankmem.jsonl'}"


def test_a_killed_actor_ends_the_job_naming_its_rank(tmp_path: Path) -> None:
    started = time.monotonic()
    proc, mark = launch(tmp_path, "--nproc-per-node", "2", "--task", "grpo", "--steps", "400", "--timeout-s", "200")
    log = tmp_path / "rankmem.jsonl"
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):  # the header and two steps
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() - started < LAUNCH_TIMEOUT_S
            time.sleep(0.2)
        victim = json.loads(log.read_text().splitlines()[0])["ranks"][1]
        os.kill(victim["pid"], signal.SIGKILL)  # as the kernel's OOM killer would
        killed = time.monotonic()
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"ray launch killed: exit after {time.monotonic() - killed:.1f} s, whole test "
          f"{time.monotonic() - started:.1f} s")
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    prefix = f"rankmem train: rank 1 (pid {victim['pid']} on {victim['host']}) died at step "
    assert last.startswith(prefix), err[-3000:]
    assert last.endswith(f"; every step logged before it is in {log}")
    header, steps = read_log(tmp_path)  # every line parses
    step = int(last[len(prefix):].split(":")[0])
    # Every step before the one the driver was waiting for; and that step too where the kill came after
    # rank 1's last collective of it (the logging rank then finished it), never a gap.
    assert [s["step"] for s in steps] in (list(range(step)), list(range(step + 1)))
    assert_nothing_left(mark)


# ---- no cluster needed -------------------------------------------------------------------------------------


def test_placements_number_ranks_per_node() -> None:
    from rankmem.ray.group import Placement, placements

    assert placements({0: "a", 1: "b", 2: "a", 3: "b"}) == [
        Placement("a", 0, 2), Placement("b", 0, 2), Placement("a", 1, 2), Placement("b", 1, 2)]


def test_how_many_fit() -> None:
    from rankmem.ray.cluster import fit_message, how_many_fit

    nodes = [{"CPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    assert how_many_fit(nodes, {"CPU": 10.0, "GPU": 2.0}, {"CPU": 1.0}, one_node=True) == 8
    assert how_many_fit(nodes, {"CPU": 10.0, "GPU": 2.0}, {"CPU": 1.0}, one_node=False) == 10
    assert how_many_fit(nodes, {"CPU": 3.0, "GPU": 2.0}, {"CPU": 1.0}, one_node=False) == 3  # the rest is taken
    assert how_many_fit(nodes, {"CPU": 10.0, "GPU": 2.0}, {"CPU": 0.1}, one_node=True) == 80  # not 79
    assert how_many_fit(nodes, {"CPU": 10.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}, one_node=True) == 2
    assert fit_message(4, {"CPU": 1.0, "GPU": 1.0}, 2, {"CPU": 10.0, "GPU": 2.0}, {"CPU": 10.0, "GPU": 2.0}, 2,
                       True) == (
        "4 ranks of 1 CPU, 1 GPU each do not fit in the Ray cluster (10 CPU (10 free), 2 GPU (2 free) on 2 nodes, "
        "ranks on one node): 2 fit; use --nproc-per-node 2, or a smaller --ray-gpus-per-actor "
        "(fractions share devices)")


def _gone(pid: int) -> bool:
    """Exited (a zombie awaiting its reaper counts): no process of that PID runs."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_local_start_that_fails_leaves_no_process_behind() -> None:
    """Ray raises when its raylet does not register within 30 s, leaving the GCS and raylet it started
    running: start_local stops every process the failed start added (here a real child and grandchild,
    started as Ray's ``init`` starts its own), keeps those that were there before, and re-raises."""
    from rankmem.ray.cluster import start_local

    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started: list[int] = []

    class FailingRay:
        def init(self, **options: Any) -> None:
            assert options == {"include_dashboard": False, "num_cpus": 2}
            gcs = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                    "time.sleep(60)"])
            started.append(gcs.pid)
            deadline = time.monotonic() + 30
            while len(psutil.Process(gcs.pid).children()) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            started.extend(c.pid for c in psutil.Process(gcs.pid).children())
            raise Exception("The current node timed out during startup.")

        def shutdown(self) -> None:
            raise RuntimeError("Ray never connected")  # what shutdown does then is not ours to trust

    try:
        with pytest.raises(Exception, match="timed out during startup"):
            start_local(FailingRay(), num_cpus=2)  # type: ignore[arg-type]
        assert len(started) == 2
        for pid in started:
            assert _gone(pid), pid
        assert before.poll() is None  # not one of the failed start's
    finally:
        before.kill()
        before.wait(10)


def test_is_ray_process() -> None:
    from rankmem.integrations.ray import is_ray_process

    ray_dir = "/venv/site-packages/ray/"
    assert is_ray_process(["ray::IDLE"], ray_dir) and is_ray_process(["ray::EngineActor.step"], None)
    assert is_ray_process([ray_dir + "core/src/ray/raylet/raylet", "--raylet_socket_name=x"], ray_dir)
    assert is_ray_process(["/venv/bin/python", "-u", ray_dir + "_private/log_monitor.py", "--x"], ray_dir)
    assert not is_ray_process(["/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"], ray_dir)
    assert not is_ray_process(["/venv/bin/python", "train.py", "--data", ray_dir + "x"], ray_dir)  # an argument
    assert not is_ray_process([], ray_dir)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exec -a and /proc")
def test_aware_probe_counts_own_workers_and_leaves_out_ray_subtrees() -> None:
    from rankmem.integrations.ray import RayAwareHostProbe
    from rankmem.probe.host import make_host_probe

    # A worker of ours (python holding 64 MiB), and a process titled as Ray titles its workers with a
    # child of its own: the title and everything under it are Ray's.
    worker = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    fake_ray = subprocess.Popen(["bash", "-c", "sleep 60 & exec -a ray::IDLE sleep 60"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                titles = psutil.Process(fake_ray.pid).cmdline()[:1]
                if titles == ["ray::IDLE"] and psutil.Process(fake_ray.pid).children() and \
                        psutil.Process(worker.pid).memory_info().rss > 64 << 20:
                    break
            except psutil.Error:
                pass
            time.sleep(0.1)
        plain, aware = make_host_probe(children_refresh_s=0.01), RayAwareHostProbe(children_refresh_s=0.01)
        everything, ours = plain.read().children_rss, aware.read().children_rss
        plain.close()
        aware.close()
        # Earlier tests may have left children of this process behind (a tracker's service): they count.
        ray_tree = {fake_ray.pid, *(c.pid for c in psutil.Process(fake_ray.pid).children(recursive=True))}
        expected = sum(rss_of(c) for c in psutil.Process().children(recursive=True) if c.pid not in ray_tree)
        assert rss_of(psutil.Process(worker.pid)) > 64 << 20
        assert ours is not None and abs(ours - expected) < 8 * 2**20
        ray_rss = sum(rss_of(psutil.Process(p)) for p in ray_tree)
        assert everything is not None and everything >= ours + ray_rss - 8 * 2**20
        assert aware.ray_processes_left_out == 1  # the subtree once
    finally:
        for p in (worker, fake_ray):
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
            p.kill()
            p.wait(timeout=10)


def rss_of(p: psutil.Process) -> int:
    try:
        return int(p.memory_info().rss)
    except psutil.Error:
        return 0


def test_ray_charged_bytes_is_uss() -> None:
    from rankmem.integrations.ray import ray_charged_bytes

    ours = ray_charged_bytes()
    theirs = psutil.Process().memory_full_info().uss
    assert ours is not None and abs(ours - theirs) < 4 * 2**20


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    started = time.monotonic()
    assert main(["train", "--launcher", "ray", "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - started < 30
    assert capsys.readouterr().err.splitlines() == [
        f"rankmem train: error: cannot reach the Ray cluster at --ray-address 127.0.0.1:{port} (Connection refused): "
        "start it with `ray start --head` there, or leave --ray-address out to start a local one"]
    assert main(["train", "--ray-address", "10.0.0.1:6379"]) == 2
    assert capsys.readouterr().err == "rankmem train: error: --ray-address and --ray-*-per-actor need --launcher ray\n"
    assert main(["train", "--launcher", "ray", "--rdzv-endpoint", "10.0.0.1:29500"]) == 2
    assert capsys.readouterr().err == ("rankmem train: error: --rdzv-endpoint is a torchrun option: with --launcher "
                                       "ray "
                                       "the driver starts every rank from one command (use --nnodes for the node "
                                       "count)\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["train", "--launcher", "ray"]) == 2
    assert capsys.readouterr().err == ("rankmem train: error: rankmem train --launcher ray needs ray, which is not "
                                       "installed: pip install 'rankmem[ray]'\n")


# ---- one in-process driver, several checks on its cluster (last: the module's cluster outlives them)
# ---------------------------------------------

BALLAST_MIB = 256


def ballast_actor_class() -> type:
    """The reference actor, with ``BALLAST_MIB`` held by rank 1: a rank that holds more memory. Built in
    a function (Ray ships it by value) so that collecting this module imports no torch."""
    from rankmem.ray.actor import EngineActor

    class Ballast(EngineActor):
        def build(self, job: Any, launch: dict[str, Any]) -> dict[str, Any]:
            if self.rank == 1:
                self.ballast = np.ones(BALLAST_MIB * 2**20 // 8)  # written: resident
            return super().build(job, launch)

    return Ballast


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A local cluster started by this process; ``cluster.children_before`` are the children it had before."""
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    start_ray(ray, num_cpus=2, logging_level="ERROR",
              runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        yield argparse.Namespace(ray=ray, children_before=children_before)
    finally:
        ray.shutdown()


def test_the_kept_result_names_the_worst_rank_which_rank_0s_own_figures_hide(cluster: Any, tmp_path: Path) -> None:
    from rankmem.engine.options import add_job_arguments, resolve_job_options
    from rankmem.integrations.ray import ray_charged_bytes
    from rankmem.ray.group import Resources, WorkerGroup

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    job = parser.parse_args(["--task", "sft", "--steps", "3", "--out", str(tmp_path), "--batch-size", "8"])
    resolve_job_options(job)
    group = WorkerGroup(ballast_actor_class(), 2, Resources(num_cpus=0.5))
    try:
        assert group.setup("cpu", 120) == ["cpu", "cpu"]
        group.call("build", job, {"launcher": "test"})
        for step in range(3):
            results = group.call("step", step)
        local = group.call("local_figures")
        pids = [w["pid"] for w in group.call("whereami")]
        charged = [ray_charged_bytes(pid) for pid in pids]
        group.call("finish")
    finally:
        group.shutdown()
    assert results[0] == results[1]  # every rank returns the same aggregate: keeping data[0] loses nothing
    kept = results[0]
    assert kept["mem/host/rss_gib/max_rank"] == 1
    assert kept["perf/cpu_memory_used_gb"] == kept["mem/host/rss_gib/max"]
    gap = kept["mem/host/rss_gib/max"] - local[0]["mem/host/rss_gib"]
    assert gap * 1024 > BALLAST_MIB - 32, (kept, local[0])  # rank 0's own figure hides the ballast
    # What Ray's memory monitor charges each actor (USS) against rankmem's RSS: RSS also counts the
    # shared libraries every worker maps.
    for rank, uss in enumerate(charged):
        rss = local[rank]["mem/host/rss_gib"] * 2**30
        assert uss is not None and 0 < uss < rss
        print(f"rank {rank}: rankmem RSS {rss / 2**20:.0f} MiB, Ray's USS {uss / 2**20:.0f} MiB, "
              f"RSS - USS {(rss - uss) / 2**20:.0f} MiB")


def stalled_publisher_actor_class() -> type:
    """The reference actor whose logging rank's publisher thread never wakes on its own (as on a
    starved 2-core machine): its records wait in the queue until something flushes it."""
    from rankmem.ray.actor import EngineActor

    class Stalled(EngineActor):
        def build(self, job: Any, launch: dict[str, Any]) -> dict[str, Any]:
            from rankmem.publish.publisher import Publisher

            Publisher.POLL_S = 3600.0  # this actor's process only: records wait for a flush
            return super().build(job, launch)

    return Stalled


def test_shutdown_lets_the_actors_write_what_they_hold_before_the_kill(cluster: Any, tmp_path: Path) -> None:
    """ray.kill alone ends an actor without its exit handlers: the records the logging rank's sink thread
    had not written yet were lost (CI: the killed-actor test's log missed the last step before the death)."""
    from rankmem.engine.options import add_job_arguments, resolve_job_options
    from rankmem.ray.group import Resources, WorkerGroup

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    job = parser.parse_args(["--task", "sft", "--steps", "3", "--out", str(tmp_path), "--batch-size", "8"])
    resolve_job_options(job)
    wait_for_free_cpus(cluster, 2)
    group = WorkerGroup(stalled_publisher_actor_class(), 2, Resources(num_cpus=0.5))
    try:
        group.setup("cpu", 120)
        group.call("build", job, {"launcher": "test"})
        for step in range(3):
            group.call("step", step)
        # The publisher went to sleep after the header. A collect now waits up to 0.2 s for the record
        # before it (so a step is on disk before the next returns), which may have let some through:
        # what must hold is that after shutdown every step is there, below.
        lines = (tmp_path / "rankmem.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["kind"] == "header"
    finally:
        started = time.monotonic()
        group.shutdown()
    print(f"shutdown with a stalled publisher: {time.monotonic() - started:.1f} s")
    header, steps = read_log(tmp_path)
    assert header["world_size"] == 2
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(len(s["ranks"]["mem/host/rss_gib"]) == 2 for s in steps)  # the per-rank batch too


def wait_for_free_cpus(cluster: Any, cpus: float) -> None:
    deadline = time.monotonic() + 20  # the previous test's placement group is being freed
    while cluster.ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)


def test_ray_helpers_are_not_the_drivers_children(cluster: Any) -> None:
    from rankmem.integrations.ray import RayAwareHostProbe
    from rankmem.probe.host import make_host_probe

    plain, aware = make_host_probe(), RayAwareHostProbe()
    try:
        everything, ours = plain.read().children_rss, aware.read().children_rss
    finally:
        plain.close()
        aware.close()
    # This process started the cluster: gcs_server, raylet and Ray's helpers are its children; only the
    # children it had before (earlier tests' leftovers, if any) are its own.
    own = sum(rss_of(p) for p in psutil.Process().children(recursive=True) if p.pid in cluster.children_before)
    assert ours is not None and abs(ours - own) < 8 * 2**20
    assert everything is not None and everything - ours > 100 * 2**20
    assert aware.ray_processes_left_out >= 3


def test_more_ranks_than_the_cluster_holds_is_one_line(cluster: Any) -> None:
    from rankmem.errors import RankmemError
    from rankmem.ray.cluster import check_fit

    wait_for_free_cpus(cluster, 2)
    with pytest.raises(RankmemError) as info:
        check_fit(5, {"CPU": 1.0}, one_node=True)
    assert str(info.value) == ("5 ranks of 1 CPU each do not fit in the Ray cluster (2 CPU (2 free) on 1 node): "
                               "2 fit; use --nproc-per-node 2, or a smaller --ray-cpus-per-actor (fractions share "
                               "cores)")
