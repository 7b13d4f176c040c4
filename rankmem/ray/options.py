"""The launch options of ``rankmem train --launcher ray``. Imports neither ray nor torch, so the
``rankmem`` CLI can build its parser without them."""

from __future__ import annotations

import argparse

from rankmem.errors import RankmemError


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="an existing Ray cluster (HOST:PORT of its head, ray://HOST:PORT, or auto); "
                            "default: start a local one for the job")
    group.add_argument("--ray-cpus-per-actor", type=float, default=1.0, metavar="N",
                       help="CPUs each rank's actor reserves, fractions allowed (default 1)")
    group.add_argument("--ray-gpus-per-actor", type=float, default=None, metavar="N",
                       help="GPUs each rank's actor reserves (default: 1 when the job runs on cuda, else 0)")


def check(args: argparse.Namespace) -> None:
    """The launch options that make no sense with Ray, and bad resource figures: one line each."""
    for flag, dest, default in (("--rdzv-endpoint", "rdzv_endpoint", None), ("--node-rank", "node_rank", 0)):
        if getattr(args, dest) != default:
            raise RankmemError(f"{flag} is a torchrun option: with --launcher ray the driver starts every rank "
                               "from one command (use --nnodes for the node count)")
    if not str(args.nnodes).isdigit() or int(args.nnodes) < 1:
        raise RankmemError(f"--nnodes must be a whole number >= 1 with --launcher ray, got {args.nnodes}")
    if args.nproc_per_node < 1:
        raise RankmemError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if not args.ray_cpus_per_actor > 0:
        raise RankmemError(f"--ray-cpus-per-actor must be > 0, got {args.ray_cpus_per_actor}")
    if args.ray_gpus_per_actor is not None and not args.ray_gpus_per_actor >= 0:
        raise RankmemError(f"--ray-gpus-per-actor must be >= 0, got {args.ray_gpus_per_actor}")


def check_unused(args: argparse.Namespace) -> None:
    """The torchrun path: Ray's options without ``--launcher ray`` are a user error, not silently ignored."""
    if args.ray_address is not None or args.ray_cpus_per_actor != 1.0 or args.ray_gpus_per_actor is not None:
        raise RankmemError("--ray-address and --ray-*-per-actor need --launcher ray")
