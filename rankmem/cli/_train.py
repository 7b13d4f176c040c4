"""``rankmem train``: launch the reference engine worker under torchrun.

One node::

    rankmem train --nproc-per-node 2 --task grpo --engine ddp --out runs/demo

Several nodes: run the same line on every node, with ``--nnodes N --node-rank I --rdzv-endpoint
HOST:PORT`` (HOST is reachable from every node, e.g. node 0's address). The job is
``python -m torch.distributed.run ... -m rankmem.engine.train ...`` in a subprocess; its exit status is
ours, so a rank that fails fails the command (torchrun shows that rank's traceback).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys

from rankmem.engine.options import add_job_arguments, job_argv, resolve_job_options
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.ray import options as ray_options

ENTRY = "rankmem.engine.train"
GRACE_S = 10.0  # after SIGTERM, how long torchrun gets to stop its workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launch (passed to torchrun)")
    launch.add_argument("--launcher", choices=("torchrun", "ray"), default="torchrun",
                        help="torchrun (default), or ray: one Ray actor per rank, driven by this process")
    launch.add_argument("--nproc-per-node", type=int, default=2, help="ranks on this node (default 2)")
    launch.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous, the same on every node")
    launch.add_argument("--rdzv-id", default="rankmem", help="job id shared by the nodes (default rankmem)")
    launch.add_argument("--timeout-s", type=float, default=None, help="stop the launch after this many seconds")
    ray_options.add_arguments(parser.add_argument_group("ray (with --launcher ray)"))
    add_job_arguments(parser.add_argument_group("job"))  # type: ignore[arg-type]


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The full torchrun command line for ``args`` (its job options resolved and checked in place)."""
    if args.nproc_per_node < 1:
        raise RankmemError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    resolve_job_options(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
           "--max-restarts", "0"]
    if str(args.nnodes) == "1" and args.rdzv_endpoint is None:
        cmd.append("--standalone")  # a local rendezvous on a free port
    else:
        if args.rdzv_endpoint is None:
            raise RankmemError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every node (e.g. node 0's address:29500)")
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    return [*cmd, "-m", ENTRY, *job_argv(args)]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launch's process group (torchrun and its workers), then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        raise MissingExtraError("rankmem train", "torch", "torch")
    if args.launcher == "ray":
        from rankmem.ray.launcher import run as run_on_ray

        return run_on_ray(args)
    ray_options.check_unused(args)
    cmd = torchrun_command(args)
    # One thread per rank: ranks share the node's cores, and oversubscription slows every step.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Own session: a timeout or Ctrl-C stops torchrun and all of its workers, nothing else.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        print(f"rankmem train: stopped after --timeout-s {args.timeout_s:g}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        _stop(proc)
        return 130
    if code != 0:
        print(f"rankmem train: the job failed (exit {code}); the failing rank's error is above. "
              f"Every step logged before it is in {os.path.join(args.out, 'rankmem.jsonl')}", file=sys.stderr)
    return code
