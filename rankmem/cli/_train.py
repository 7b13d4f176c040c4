"""``rankmem train``: launch the reference engine worker under torchrun.

One node::

    rankmem train --nproc-per-node 2 --task grpo --engine ddp --out runs/demo

Several nodes: run the same line on every node, with ``--nnodes N --node-rank I --rdzv-endpoint
HOST:PORT``. The job is ``python -m torch.distributed.run ... -m rankmem.engine.train ...`` in a
subprocess; its exit status is ours.

A rank killed by a signal leaves no traceback and torchrun may blame a healthy rank, so the job runs
with ``RANKMEM_HEARTBEAT_DIR=OUT/heartbeat`` and ``RANKMEM_RUN_ID``, and torchrun's stderr passes through
this process into ``OUT/torchrun.log``. When the job fails, the launcher's diagnosis is printed last
(and the killed or stalled rank written as an event). SIGTERM, SIGHUP or SIGINT is forwarded to every
process of the job (:mod:`rankmem.cli._jobtree`), which get :data:`GRACE_S` before SIGKILL; the command
then exits with 128 + the signal's number. Every option is checked, and ``OUT/.lock`` taken, before
torchrun starts: a bad one is one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from rankmem.cli import _diagnose
from rankmem.cli._jobtree import JobTree, Signalled, SignalWatch
from rankmem.cli._relay import StderrRelay, first_traceback
from rankmem.core.lock import ENV_HELD, RunDirLock
from rankmem.core.rundir import ENV_RUN_ID, RunDir, current_run_id, rotated_lines
from rankmem.engine.options import PACKED_ENV, add_job_arguments, job_argv, resolve_job_options
from rankmem.errors import MissingExtraError, RankmemError
from rankmem.forensics import heartbeat as _heartbeat
from rankmem.forensics import nearoom as _nearoom
from rankmem.forensics.events import EventWriter
from rankmem.ray import options as ray_options

ENTRY = "rankmem.engine.train"
GRACE_S = 10.0  # after SIGTERM (or the signal forwarded), how long the job's processes get to exit
SAMPLE_S = 1.0  # how often the launcher samples the ranks' process states while the job runs
MAX_LOCAL_RANKS = 4096
RANK_FLOOR_BYTES = 256 << 20
"""What a CPU rank needs at the least (the interpreter, torch and gloo: ~230 MiB RSS measured here)."""
MAX_NODES = 1 << 16
MAX_TIMEOUT_S = 365 * 86400.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launch (passed to torchrun)")
    launch.add_argument("--launcher", choices=("torchrun", "ray"), default="torchrun",
                        help="torchrun (default), or ray: one Ray actor per rank, driven by this process")
    launch.add_argument("--nproc-per-node", type=int, default=2, help="ranks on this node (default 2)")
    launch.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    launch.add_argument("--rdzv-endpoint", default=None,
                        help="HOST:PORT of the c10d rendezvous, the same on every node")
    launch.add_argument("--rdzv-id", default="rankmem", help="job id shared by the nodes (default rankmem)")
    launch.add_argument("--timeout-s", type=float, default=None, help="stop the launch after this many seconds")
    ray_options.add_arguments(parser.add_argument_group("ray (with --launcher ray)"))
    add_job_arguments(parser.add_argument_group("job"))  # type: ignore[arg-type]


def check_launch_options(args: argparse.Namespace) -> None:
    """The launch options of either launcher, checked before anything starts."""
    if args.nproc_per_node < 1:
        raise RankmemError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    most = local_rank_capacity()
    if args.nproc_per_node > most:
        raise RankmemError(f"--nproc-per-node {args.nproc_per_node} is more ranks than this node can hold: at most "
                           f"{most} (each rank needs ~{RANK_FLOOR_BYTES >> 20} MiB of the memory available)")
    low, _, high = str(args.nnodes).partition(":")
    try:
        nodes = (int(low), int(high or low)) if len(low) < 8 and len(high) < 8 else (0, 0)
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1] <= MAX_NODES:
        raise RankmemError(f"--nnodes must be a number of nodes in 1..{MAX_NODES}, or MIN:MAX with 1 <= MIN <= MAX; "
                           f"got {args.nnodes!r}")
    if not 0 <= args.node_rank < nodes[1]:
        raise RankmemError(f"--node-rank must be in 0..{nodes[1] - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    if args.timeout_s is not None and not 0 < args.timeout_s <= MAX_TIMEOUT_S:  # `not` also refuses NaN
        raise RankmemError(f"--timeout-s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}] (a year), "
                           f"got {args.timeout_s}")


def local_rank_capacity() -> int:
    """The most ranks this node can hold: its available memory over a rank's floor, within a hard cap."""
    from rankmem.engine.options import available_bytes

    available = available_bytes()
    if available is None:
        return MAX_LOCAL_RANKS
    return max(1, min(MAX_LOCAL_RANKS, available // RANK_FLOOR_BYTES))


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The full torchrun command line for ``args`` (its options resolved and checked in place)."""
    check_launch_options(args)
    resolve_job_options(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
           "--max-restarts", "0"]
    if str(args.nnodes) == "1" and args.rdzv_endpoint is None:
        cmd.append("--standalone")  # a local rendezvous on a free port
    else:
        if args.rdzv_endpoint is None:
            raise RankmemError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every node (e.g. node 0's "
                               "address:29500)")
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    return [*cmd, "-m", ENTRY, *job_argv(args)]


def check_local_device(args: argparse.Namespace) -> None:
    """``--device cuda`` needs CUDA here, and (``cuda`` or ``auto`` on a CUDA node) a device per local
    rank: torchrun's ranks run on this node, local rank r on ``cuda:r`` (every rank, or the ranks past
    the device count, would fail with a traceback)."""
    if args.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        if args.device != "cuda":
            return
        cuda = torch.version.cuda
        build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}, no device visible"
        raise RankmemError(f"--device cuda, but this torch {torch.__version__} has no CUDA device ({build}): "
                           "use --device cpu, or auto")
    devices = torch.cuda.device_count()
    if args.nproc_per_node > devices:
        raise RankmemError(f"--nproc-per-node {args.nproc_per_node} needs a CUDA device per rank, and this node has "
                           f"{devices}: use --nproc-per-node {devices}, or --device cpu")


def lock_run_dir(out: str) -> RunDirLock:
    """Create ``--out`` and take its lock for the whole job (see :mod:`rankmem.runlog.lock`)."""
    lock = RunDirLock(out)
    try:
        lock.acquire()
    except RankmemError as exc:
        raise RankmemError(f"--out {exc}") from None
    return lock


def prepare_heartbeat_dir(out: str) -> str:
    """``OUT/heartbeat``, created (an earlier run's heartbeats were moved aside with its other files);
    a plain file there is refused before anything is rotated."""
    check_heartbeat_dir(out)
    directory = RunDir(out).heartbeat
    os.makedirs(directory, exist_ok=True)
    return directory


def check_heartbeat_dir(out: str) -> str:
    """``OUT/heartbeat``; RankmemError, before anything of an earlier run is moved, when something
    that is not a directory holds its name (a plain file: makedirs would raise FileExistsError)."""
    directory = os.path.join(out, "heartbeat")
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise RankmemError(f"{directory} exists and is not a directory: rankmem train writes each rank's "
                           "heartbeat there; move it aside (or pick another --out)")
    return directory


def rotate_earlier_run(out: str) -> None:
    """Move every file of an earlier run in ``OUT`` aside, with one number (:class:`RunDir`), saying so
    in one line each: here, before the launch, rather than as a warning from the logging rank."""
    try:
        moved = RunDir(out).rotate(None, _heartbeat.heartbeat_run_id)
    except OSError as exc:  # another node's launcher sharing OUT moved it first, a read-only OUT
        say(f"cannot move the earlier run's files in {out} aside ({exc.strerror or exc}); readers tell them "
            "apart by their run id")
        return
    for line in rotated_lines(moved):
        say(line)


def say(line: str) -> None:
    """One line of ours on stderr, which may be closed (we go on without it)."""
    if sys.stderr is None:  # started with 2>&-
        return
    try:
        print(f"rankmem train: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def oom_kills() -> _diagnose.OomKills:
    return _diagnose.OomKills(_nearoom.oom_kill_count(), _nearoom.node_oom_kill_count())


def explain(stderr_text: str, heartbeat_dir: str, before: _diagnose.OomKills, out: str,
            states: _diagnose.RankStates, run_id: str | None = None) -> list[_diagnose.Finding]:
    """The diagnosis, its events written (this run's heartbeats only); printing is the caller's, last."""
    beats = _heartbeat.read_heartbeats(heartbeat_dir, run_id)
    findings = _diagnose.diagnose(stderr_text, beats, before, oom_kills(), time.time(), states.last)
    for finding in findings:
        writer = EventWriter(out, finding.rank, run_id)
        writer.write(finding.event)
        writer.close()
    return findings


def conclude(relay: StderrRelay, code: int, findings: list[_diagnose.Finding], out: str) -> None:
    """What the terminal sees of a failed job, the diagnosis last: a killed or stalled rank named (the
    others' errors are its fallout, kept in the launch log); else the failing rank's own traceback, once."""
    log = relay.log_path
    where = f"torchrun's report and every rank's output are in {log}; " if log else ""
    # torchrun itself died by a signal: say so, with the status the launcher exits with (128 + N, as a shell)
    status = f"{128 - code}: torchrun was killed by {_diagnose.signal_name(code)}" if code < 0 else str(code)
    logged = f"every step logged before it is in {RunDir(out).log}"
    if findings:
        for finding in findings[:-1]:
            say(finding.line)
        say(f"the job failed (exit {status}): {findings[-1].line}. {where}{logged}")
        return
    found = first_traceback(relay.first_traceback_text())
    if found is None:
        relay.release()
        say(f"the job failed (exit {status}); {where}{logged}")
        return
    block, exc, rank = found
    relay.release("" if relay.traceback_shown else block)
    who = f" on {rank.replace('rank', 'rank ')}" if rank else ""
    say(f"the job failed (exit {status}): {exc}{who} (its traceback above). {where}{logged}")


def timed_out(relay: StderrRelay, findings: list[_diagnose.Finding], timeout_s: float) -> int:
    """The end of a job stopped at ``--timeout-s`` (SIGTERM sent): what the diagnosis found, then where
    the rest of its output went; exit status 124, as timeout(1)."""
    relay.wait(GRACE_S)
    for finding in findings:
        say(finding.line)
    say(f"stopped after --timeout-s {timeout_s:g}; the job's output from then on is in "
        f"{relay.log_path or 'no file (OUT cannot be written)'}")
    return 124


def signalled(relay: StderrRelay, signum: int, killed: list[int]) -> int:
    """The end of a job stopped by the signal the user sent us (forwarded to it; ``killed``: the
    processes that needed SIGKILL after the grace); exit status 128 + the signal's number."""
    relay.wait(GRACE_S)
    late = f"; {len(killed)} needed SIGKILL after the grace period" if killed else ""
    where = f"; the job's output from then on is in {relay.log_path}" if relay.log_path else ""
    say(f"stopped by {signal.Signals(signum).name}: sent it to the job's processes (torchrun and every rank)"
        f"{late}{where}")
    return 128 + signum


def wait_sampling(proc: subprocess.Popen[bytes], timeout_s: float | None, sample: Callable[[], None]) -> int:
    """``proc.wait(timeout_s)``, calling ``sample()`` every :data:`SAMPLE_S` meanwhile; raises
    ``subprocess.TimeoutExpired`` at the timeout."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait_s = SAMPLE_S if deadline is None else max(0.0, min(SAMPLE_S, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        sample()


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        raise MissingExtraError("rankmem train", "torch", "torch")
    # Every check first, then the lock, then the earlier run moved aside under it: a refused option or a
    # --out in use by a live job must leave OUT as it was (moving a live job's log hid it from watch).
    if args.launcher == "ray":
        from rankmem.engine.options import resolve_job_options
        from rankmem.ray.cluster import import_ray
        from rankmem.ray.launcher import run as run_on_ray

        import_ray()  # a missing ray refuses the launch before OUT (and its .lock) is created
        check_launch_options(args)
        ray_options.check(args)
        resolve_job_options(args)
        claim_run_dir(args).release()  # the logging actor's writer takes it again when it opens
        return run_on_ray(args)
    ray_options.check_unused(args)
    cmd = torchrun_command(args)
    check_local_device(args)
    lock = claim_run_dir(args)
    try:
        return launch(args, cmd, lock)
    finally:
        lock.release()


def claim_run_dir(args: argparse.Namespace) -> RunDirLock:
    """Take ``--out``'s lock and move an earlier run aside under it. With several nodes, a launcher takes
    neither (each node's launcher would refuse the others on a shared ``--out``): the logging rank's
    writer takes the lock and moves an earlier log aside when it opens, wherever it runs."""
    lock = RunDirLock(args.out)
    if str(args.nnodes) != "1" and args.launcher != "ray":  # Ray: one driver, whatever the node count
        os.makedirs(args.out, exist_ok=True)
        return lock  # not held: release() is a no-op, and the ranks get no ENV_HELD
    check_heartbeat_dir(args.out)  # before the lock and the rotation: a refused job moves nothing aside
    lock = lock_run_dir(args.out)
    rotate_earlier_run(args.out)
    return lock


def job_environment(args: argparse.Namespace, heartbeat_dir: str, lock: RunDirLock) -> dict[str, str]:
    """torchrun's environment: ours, plus where the ranks beat, the run's id and the lock they inherit."""
    # One thread per rank: ranks share the node's cores, and oversubscription slows every step.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), _heartbeat.ENV_DIR: heartbeat_dir,
           ENV_RUN_ID: os.environ.get(ENV_RUN_ID) or secrets.token_hex(8)}
    if lock.held:
        env[ENV_HELD] = lock.path
    if getattr(args, "ppo_max_token_len_per_gpu", None) is not None:
        env = {**PACKED_ENV, **env}  # the user's own settings win
    return env


def launch(args: argparse.Namespace, cmd: list[str], lock: RunDirLock) -> int:
    """Run torchrun's ``cmd`` to its end, or stop all of it (timeout, signal); returns the exit status."""
    heartbeat_dir = prepare_heartbeat_dir(args.out)
    env = job_environment(args, heartbeat_dir, lock)
    run_id = current_run_id(env)  # the ranks' (attempt 0: this launcher runs torchrun without restarts)
    before = oom_kills()
    with SignalWatch() as signals:
        # Own session: a Ctrl-C at the terminal reaches this process alone, which forwards it to the job.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        tree = JobTree(proc.pid, f"{_heartbeat.ENV_DIR}={heartbeat_dir}")
        relay = StderrRelay(proc.stderr, sys.stderr, RunDir(args.out).launch_log)
        states = _diagnose.RankStates()

        def sample() -> None:
            beats = _heartbeat.read_heartbeats(heartbeat_dir, run_id)
            states.sample(proc.pid, beats)
            tree.refresh(b.pid for b in beats.values())
            relay.tick()

        def stop(sig: int) -> list[int]:
            return tree.stop(sig, GRACE_S, proc.poll, signals.hurry)

        try:
            signals.arm()
            try:
                code = wait_sampling(proc, args.timeout_s, sample)
            except subprocess.TimeoutExpired:
                # Read the heartbeats and states before stopping: the stop itself ends every rank's progress.
                sample()
                relay.hold()
                findings = explain(relay.text(), heartbeat_dir, before, args.out, states, run_id)
                stop(signal.SIGTERM)
                return timed_out(relay, findings, args.timeout_s)
            left = tree.alive()  # ranks that outlive torchrun (it was killed): nothing may outlive us
            if left:
                stop(signal.SIGTERM)
                say(f"{len(left)} process(es) of the job outlived torchrun; stopped them")
            relay.wait(GRACE_S)
            if code == 0:
                relay.release()
            else:
                conclude(relay, code, explain(relay.text(), heartbeat_dir, before, args.out, states, run_id), args.out)
            return 128 - code if code < 0 else code
        except Signalled as exc:
            relay.hold()  # the ranks' and torchrun's tracebacks of the user's own signal: to the file only
            return signalled(relay, exc.signum, stop(exc.signum))
        finally:
            signals.disarm()
            relay.close()
