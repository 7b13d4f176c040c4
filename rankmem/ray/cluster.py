"""The Ray cluster a job runs on: a local one started for the job, or an existing one by address, and
whether the job's ranks fit in it. Every way this goes wrong is one line (a :class:`RankmemError`).

An unreachable address: ``ray.init(address=...)`` retries for minutes (20 attempts of up to 30 s in
Ray 2.60) and cannot be interrupted, so the address is first tried with a plain TCP connect
(``REACH_TIMEOUT_S``), and a port that accepts but is no Ray cluster ends the process after
``CONNECT_TIMEOUT_S`` (exit 2, one line): nothing has been started by then.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rankmem.core.guard import attempt
from rankmem.errors import MissingExtraError, RankmemError

REACH_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 25.0


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError("rankmem train --launcher ray", "ray", "ray") from exc
    return ray


@dataclass
class Cluster:
    """The cluster this driver is connected to."""

    address: str
    """``local`` for a cluster started for the job, else the address given."""
    started: bool
    """Whether this driver started it: :func:`disconnect` then stops every one of its processes."""
    session_dir: str | None
    """Where Ray keeps this session's logs, when the driver can see it."""


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto`` and other forms."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise a one-line RankmemError unless a TCP connection to ``address`` opens within ``timeout_s``."""
    target = _host_port(address)
    if target is None:
        return  # `auto` and friends: ray.init fails fast when no local cluster runs
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise RankmemError(f"cannot reach the Ray cluster at --ray-address {address} ({reason}): start it with "
                           "`ray start --head` there, or leave --ray-address out to start a local one") from None


def connect(address: str | None, env_vars: dict[str, str]) -> Cluster:
    """Start a local cluster (``address`` None) or connect to ``address``. ``env_vars`` reach every
    worker of the job (through the job's runtime environment)."""
    ray = import_ray()
    if address is not None:
        check_reachable(address)
    options: dict[str, Any] = dict(runtime_env={"env_vars": env_vars}, logging_level=logging.ERROR,
                                   namespace="rankmem")
    if address is None:
        start_local(ray, **options)
    else:
        _join(ray, address, options)
    session_dir: str | None
    try:
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:  # a Ray Client (ray://) driver has no local node
        session_dir = None
    return Cluster("local" if address is None else address, address is None, session_dir)


def start_local(ray: ModuleType, **options: Any) -> None:
    """``ray.init()`` of a cluster of this process's own. When it fails (on a loaded machine Ray gives the
    raylet 30 s to register, then raises), Ray leaves the GCS and raylet it started running as this
    process's children, holding GiBs: they are stopped here before the error goes on."""
    import psutil

    me = psutil.Process()
    none: list[psutil.Process] = []
    before = {p.pid for p in attempt(me.children, recursive=True, default=none)}
    try:
        # The dashboard needs ray[default]; without it, it only costs startup time.
        ray.init(include_dashboard=False, **options)
    except BaseException:
        attempt(ray.shutdown, default=None)
        stop_processes([p for p in attempt(me.children, recursive=True, default=none) if p.pid not in before])
        raise


def stop_processes(procs: list[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, for psutil processes; those already gone are skipped."""
    import psutil

    for proc in procs:
        attempt(proc.terminate, default=None)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        attempt(proc.kill, default=None)
    psutil.wait_procs(alive, timeout=grace_s)


def _join(ray: ModuleType, address: str, options: dict[str, Any]) -> None:
    """``ray.init(address=...)``, bounded by CONNECT_TIMEOUT_S. Ray's C++ client writes a warning per
    retry straight to file descriptor 2; while connecting they go to a file, named if it fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    log = tempfile.NamedTemporaryFile("w+b", prefix="rankmem-ray-connect-", suffix=".log", delete=False)
    os.dup2(log.fileno(), 2)

    def give_up() -> None:
        os.write(saved, (f"rankmem train: error: no Ray cluster answered at --ray-address {address} within "
                         f"{CONNECT_TIMEOUT_S:g} s (is it the head's GCS port, default 6379? Ray's messages: "
                         f"{log.name})\n").encode())
        os._exit(2)  # ray.init cannot be interrupted; nothing was started yet, so nothing is left behind

    watchdog = threading.Timer(CONNECT_TIMEOUT_S, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        ray.init(address=address, **options)
        os.unlink(log.name)
    except ConnectionError as exc:
        log.flush()
        raise RankmemError(f"cannot connect to the Ray cluster at --ray-address {address}: {exc}; Ray's last "
                           f"message: {_last_message(log.name)} (all of them: {log.name})") from None
    finally:
        watchdog.cancel()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


def _last_message(path: str) -> str:
    """The last line of a Ray C++ log, without its ``[time level pid tid] file:line:`` prefix."""
    with open(path, "rb") as f:
        lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return "none"
    last = lines[-1]
    _, bracket, rest = last.partition("] ")
    return rest.split(": ", 1)[-1] if bracket else last


def disconnect() -> None:
    """Leave the cluster; a local cluster started for the job stops with it (gcs_server, raylet, workers)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def driver_env() -> dict[str, str]:
    """What the job's workers need from the driver's environment: this rankmem first on their path (a
    local cluster's workers then import the same code as the driver; on other nodes a missing path is
    skipped), and the driver's thread count."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]]
    return {"PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def how_many_fit(nodes: list[dict[str, float]], free: dict[str, float], bundle: dict[str, float],
                 one_node: bool) -> int:
    """How many actors of ``bundle`` the cluster holds: on its largest node when ``one_node``, else on
    all its nodes; never more than its free resources allow. ``nodes``: each alive node's total resources."""
    def count(resources: dict[str, float]) -> int:
        # The epsilon keeps 1 / 0.1 from flooring to 9.
        return min(math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())

    per_node = [count(n) for n in nodes]
    held = max(per_node, default=0) if one_node else sum(per_node)
    return min(held, count(free))


def check_fit(world_size: int, bundle: dict[str, float], one_node: bool) -> None:
    """One line saying how many ranks fit when ``world_size`` actors of ``bundle`` do not."""
    ray = import_ray()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    fit = how_many_fit(nodes, free, bundle, one_node)
    if fit >= world_size:
        return
    raise RankmemError(fit_message(world_size, bundle, fit, ray.cluster_resources(), free, len(nodes), one_node))


def fit_message(world_size: int, bundle: dict[str, float], fit: int, total: dict[str, float],
                free: dict[str, float], nodes: int, one_node: bool) -> str:
    need = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    have = ", ".join(f"{total.get(k, 0.0):g} {k} ({free.get(k, 0.0):g} free)" for k in bundle)
    where = f"{nodes} node{'s' if nodes != 1 else ''}" + (", ranks on one node" if one_node and nodes > 1 else "")
    short = "GPU" if "GPU" in bundle and free.get("GPU", 0.0) < world_size * bundle["GPU"] else "CPU"
    fix = f"use --nproc-per-node {fit}, or" if fit > 0 and one_node else "use"
    return (f"{world_size} ranks of {need} each do not fit in the Ray cluster ({have} on {where}): {fit} fit; "
            f"{fix} a smaller --ray-{short.lower()}s-per-actor (fractions share "
            f"{'devices' if short == 'GPU' else 'cores'})")
