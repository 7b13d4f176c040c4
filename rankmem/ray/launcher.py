"""``rankmem train --launcher ray``: the reference job as a Ray worker group, driven step by step.

    rankmem train --launcher ray --nproc-per-node 2 --task grpo --out runs/ray
    rankmem train --launcher ray --ray-address 10.0.0.1:6379 --nnodes 2 --nproc-per-node 8 --out /shared/runs/big

The driver starts a local Ray cluster (or joins ``--ray-address``), reserves one actor per rank
(``--ray-cpus-per-actor``, ``--ray-gpus-per-actor``; ``--nnodes N`` makes N x ``--nproc-per-node``
ranks, packed onto as few nodes as hold them, one node when N is 1), joins the actors into one
process group, and
calls every rank's ``step`` once per step, keeping rank 0's result as verl's driver keeps
``data[0]``: the metrics are gathered across ranks inside the step, so that one result already names
the worst rank. Progress, summary and run log are the torchrun path's. A rank that fails or dies ends
the job with exit status 1 and a line naming it; every actor is killed, and a local cluster stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from rankmem.core.rundir import RunDir
from rankmem.engine.options import JOB_OPTIONS, resolve_job_options
from rankmem.ray import cluster as clusters
from rankmem.ray import options as ray_options
from rankmem.ray.group import RankFailed, Resources, WorkerGroup

SETUP_MARGIN_S = 120.0
"""Beyond the process-group timeout, how long actors get to start (each imports torch) and join."""


def job_options(args: argparse.Namespace) -> argparse.Namespace:
    """The job options of ``args`` alone (what torchrun would forward), with ``out`` made absolute: the
    actors' working directory is the driver's only on a local cluster."""
    job = argparse.Namespace(**{flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                                for flag, _ in JOB_OPTIONS})
    job.out = os.path.abspath(job.out)
    return job


def run(args: argparse.Namespace) -> int:
    ray_options.check(args)
    resolve_job_options(args)
    clusters.import_ray()  # before anything starts: a missing extra is one line
    job = job_options(args)
    world = args.nproc_per_node * int(args.nnodes)
    deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
    previous = signal.getsignal(signal.SIGTERM)
    last_words: list[str] = []  # the diagnosis, printed once the driver has left the cluster
    try:
        cluster = clusters.connect(args.ray_address, clusters.driver_env())
        # SIGTERM (a scheduler, a timeout) unwinds like Ctrl-C, so the actors are killed and a local cluster
        # stopped in order. Set after ray.init, whose handlers (Python's sys.exit, then the core worker's
        # abort on a fatal signal) would otherwise take it.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        resources = Resources(args.ray_cpus_per_actor, _gpus_per_actor(args, job))
        one_node = int(args.nnodes) == 1
        clusters.check_fit(world, resources.bundle(), one_node)
        group = WorkerGroup(_actor_class(), world, resources, pack=one_node)
        try:
            return _drive(group, job, cluster, resources, deadline, last_words)
        finally:
            group.shutdown()
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # SIGTERM
        return int(exc.code or 143)
    finally:
        clusters.disconnect()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        # After the driver has left the cluster: Ray forwards the actors' output asynchronously, and a
        # line a dying actor wrote would otherwise land under the diagnosis, which must be the last line.
        for line in last_words:
            print(line, file=sys.stderr, flush=True)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _actor_class() -> type:
    from rankmem.ray.actor import EngineActor

    return EngineActor


def _gpus_per_actor(args: argparse.Namespace, job: argparse.Namespace) -> float:
    if args.ray_gpus_per_actor is not None:
        return float(args.ray_gpus_per_actor)
    if job.device == "auto":
        import ray

        return 1.0 if ray.cluster_resources().get("GPU", 0.0) > 0 else 0.0  # type: ignore[no-untyped-call]
    return 1.0 if job.device == "cuda" else 0.0


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _drive(group: WorkerGroup, job: argparse.Namespace, cluster: clusters.Cluster, resources: Resources,
           deadline: float | None, last_words: list[str]) -> int:
    from rankmem.engine.progress import Progress
    from rankmem.engine.train import headline

    run_log = RunDir(job.out).log
    nodes = len({p.node_id for p in group.placements})
    launch: dict[str, Any] = {"launcher": "ray", "ray_address": cluster.address, "nodes": nodes,
                              "cpus_per_actor": resources.num_cpus, "gpus_per_actor": resources.num_gpus}
    if cluster.session_dir is not None and cluster.started:
        print(f"ray: a local cluster for this job, logs in {cluster.session_dir}/logs", flush=True)
    try:
        setup_s = job.pg_timeout_s + SETUP_MARGIN_S
        left = _remaining(deadline)
        group.setup(job.device, setup_s if left is None else min(setup_s, left))
        built = group.call("build", job, launch, timeout_s=_remaining(deadline), during="while building the worker")[0]
        with Progress(True, job.steps, job.task, bar=not job.no_progress) as progress:
            for step in range(job.steps):
                # Every rank returns the same cross-rank aggregate; keep rank 0's, as verl keeps data[0].
                metrics = group.call("step", step, timeout_s=_remaining(deadline), during=f"at step {step}")[0]
                progress.advance(step, headline(metrics, job.task))
        peaks = group.call_rank(0, "summary", timeout_s=_remaining(deadline))
        group.call("finish", timeout_s=_remaining(deadline), during="while leaving the process group")
    except RankFailed as exc:
        group.shutdown()  # the survivors flush what they logged first: the message below holds
        if not exc.died:
            last_words.append(str(exc.cause))  # the rank's own traceback, as torchrun shows it
        last_words.append(f"rankmem train: {str(exc).rstrip('.')}; every step logged before it is in {run_log}")
        return 1
    except TimeoutError as exc:
        group.shutdown()
        last_words.append(f"rankmem train: stopped after --timeout-s: {exc}")
        return 124
    per_node = ", ".join(str(sum(p.node_id == n for p in group.placements))
                         for n in dict.fromkeys(p.node_id for p in group.placements))
    print(f"rankmem train: {job.task}/{job.engine}, {group.world_size} ranks, {job.steps} steps, "
          f"{built['params'] / 1e6:.2f}M params, device {built['device']}")
    print(f"ray: {group.world_size} actors on {nodes} node{'s' if nodes != 1 else ''} ({per_node} per node), "
          f"{resources.num_cpus:g} CPU and {resources.num_gpus:g} GPU each")
    print("peak memory (max over ranks and steps):")
    print("\n".join(peaks))
    print(f"run log: {run_log}", flush=True)
    return 0
