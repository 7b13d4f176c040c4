"""``rankmem doctor``: one screen that says what rankmem will measure here, and what to install.

Versions (rankmem, Python, torch), the device backend and what it reads, the host peak's scope
(``window``, ``lifetime`` or ``sampled``), the cgroup seen, whether a run directory can be written,
and which optional extras are installed, each missing one with the ``pip install`` that adds it (never
one whose pins would change the user's other packages; torch from pytorch.org's own instructions).

It never creates a device context: :func:`rankmem.sample` reads the device only where the program has
initialised it (this process has not), so the device line says what will be read once the training
code makes its first device call. ``--init-device`` initialises it here and reads it after. Extras are
looked up, not imported (importing lightning alone takes seconds). Exit status 0: it reports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

from rankmem.core.guard import load_optional
from rankmem.core.rundir import RunDir
from rankmem.core.units import GIB
from rankmem.core.version import __version__
from rankmem.forensics.heartbeat import ENV_DIR

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (extra, the modules it provides, what they enable); pyproject.toml's extras, in its order.
EXTRAS = (
    ("tensorboard", ("tensorboard",), "the tensorboard sink"),
    ("wandb", ("wandb",), "the wandb sink"),
    ("mlflow", ("mlflow",), "the mlflow sink"),
    ("plot", ("matplotlib",), "rankmem plot, and the plots in report --html"),
    ("hf", ("transformers", "accelerate"), "rankmem.integrations.hf"),
    ("lightning", ("lightning",), "rankmem.integrations.lightning"),
    ("verl", ("verl",), "a verl job: rankmem.integrations.verl needs nothing more than verl itself"),
    ("ray", ("ray",), "rankmem train --launcher ray"),
    ("nvml", ("pynvml",), "device memory by owner (docs/device-attribution.md)"),
)
IMPORTED = ("matplotlib",)
"""Extras doctor imports, not only finds: those rankmem's own commands import (plot, report --html).
The trackers and frameworks are imported by the job, and take seconds to tens of seconds each here."""
SCOPES = {
    "window": "window (VmHWM reset at each window edge through /proc/self/clear_refs)",
    "lifetime": "lifetime (this kernel cannot reset VmHWM: peak RSS is the process's lifetime peak)",
    "edges": "edges (peak_source='edges': VmHWM never reset; a window's peak is exact where it set a new "
             "lifetime high, else sampled at its edges)",
    "sampled": "sampled (no /proc: peak RSS is the max of the RSS read at window edges)",
}
# Extras doctor never suggests installing: verl's pins (ray, transformers<5.11) would change the user's
# other packages, and only rankmem's own tests use it; a verl user has verl already.
NO_HINT = {"verl"}
TORCH_INSTALL = "https://pytorch.org/get-started/locally/"
DEVICE_READS = ("allocated, reserved and their window peaks (the allocator), device used and total "
                "(mem_get_info), alloc retries and OOMs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/train", metavar="DIR",
                        help="the run directory to check for writing (default runs/train, rankmem train's)")
    parser.add_argument("--init-device", action="store_true",
                        help="initialise the device in this process (creates a context, a few hundred MiB) "
                             "and show what rankmem reads after")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.3f} GiB"


def _version(module: str) -> str | None:
    """The installed version of the distribution that provides ``module`` (mlflow-skinny provides mlflow)."""
    dists = importlib.metadata.packages_distributions().get(module, [])
    for dist in [module, *dists]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def torch_line() -> tuple[str, Any]:
    if importlib.util.find_spec("torch") is None:
        # Not `rankmem[torch]`: the build that matches the accelerator (CUDA, ROCm, CPU) comes from its own index.
        return (f"torch: not installed: install the build for your accelerator as {TORCH_INSTALL} says "
                "(until then rankmem reads host memory only)"), None
    import torch

    cuda = getattr(torch.version, "cuda", None)
    build = f"CUDA {cuda} build" if cuda else "no CUDA in this build"
    return f"torch: {torch.__version__} ({build})", torch


def device_lines(torch: Any, init: bool) -> list[str]:
    from rankmem.probe.sample import sample

    if torch is None:
        return ["device backend: none (no torch)"]
    before = sample(children=False)
    name = before.device_name
    if name == "none":
        return ["device backend: none: torch sees no cuda, npu or xpu device; rankmem reports host memory only"]
    module = getattr(torch, name)
    count = module.device_count()
    lines = [f"device backend: {name}, {count} device{'s' if count != 1 else ''} visible"]
    reading = before.device
    if reading is None or reading.before_init:
        lines.append(f"device before init: nothing read (rankmem never creates a context); after your code's "
                     f"first {name} call it reads {DEVICE_READS}")
    if init:
        module.init()
        if hasattr(module, "current_device"):
            torch.empty(1, device=f"{name}:{module.current_device()}")  # the first allocation makes the context
        after = sample(children=False).device
        if after is None or after.before_init:
            lines.append("device after init: still nothing read: this torch build hides the context from rankmem")
        else:
            lines.append(f"device after init ({name}:{module.current_device()}): allocated {_gib(after.allocated)}, "
                         f"reserved {_gib(after.reserved)}, used {_gib(after.used)} of {_gib(after.total)}")
    return lines


def attribution_lines(torch: Any) -> list[str]:
    """Whether device used can be split by owner here: the PID join through /proc, and NVML."""
    from rankmem.probe import nvml as _nvml
    from rankmem.probe.pidmap import NOT_MAPPED, pid_view

    view = pid_view()
    if view.method == NOT_MAPPED:
        join = (f"{NOT_MAPPED}: this container's /proc shows no host PID (own PID namespace, no hostPID); "
                "per-owner figures need the driver to list this namespace's PIDs, else only the unattributed rest")
    else:
        join = f"{view.method}: pid {view.own_pid} here is host pid {view.host_pid}"
    lines = [f"device attribution PID join: {join}"]
    if torch is None or not bool(torch.cuda.is_available()):
        return lines + ["device attribution: off (needs a CUDA device)"]
    nvml, why = _nvml.load()
    if nvml is None:
        return lines + [f"device attribution: unavailable: {why}"]
    device, why = _nvml.NvmlDevice.open(nvml, _nvml.uuid_candidates(torch.cuda, 0))
    if device is None:
        return lines + [f"device attribution: unavailable: {why}"]
    listing = device.processes()
    if listing.processes is None:
        return lines + [f"device attribution: limited: {listing.refused}; only this rank's reserved is known"]
    mig = ", MIG instance" if device.mig else ""
    return lines + [f"device attribution: works (NVML lists {len(listing.processes)} process(es) on cuda:0{mig}), "
                    "every nvml_refresh_s (10 s) on a thread of its own"]


def host_lines() -> tuple[list[str], str]:
    """The host lines, and the peak RSS scope on its own (for ``--json``)."""
    from rankmem.monitor import Monitor
    from rankmem.probe.sample import sample

    # A doctor run inside a job's environment must not write a heartbeat as if it were a rank.
    heartbeat_env = os.environ.pop(ENV_DIR, None)
    try:
        monitor = Monitor(device="cpu", sinks=(), children=False, leak_check=False, near_oom_watch=False,
                                  sink_thread=False)
        try:
            with monitor.step(0):  # the first reset of VmHWM is what tells whether the kernel allows it
                pass
            scope = monitor.peak_rss_scope
        finally:
            monitor.close()
    finally:
        if heartbeat_env is not None:
            os.environ[ENV_DIR] = heartbeat_env
    host = sample(device="cpu", children=False).host
    node = (f"node available {_gib(host.node_available)} of {_gib(host.node_total)}"
            if host.node_total is not None else "node memory unknown")
    return [f"host peak RSS scope: {SCOPES.get(scope, scope)}", peak_source_line(scope),
            f"host now: this process's RSS {_gib(host.rss)}, {node}",
            cgroup_line(host.cgroup_limit, host.cgroup_used)], scope


def peak_source_line(scope: str) -> str:
    """What the choice of peak source does to other tools (docs/peak-source.md)."""
    if scope == "window":
        return ("peak source: window (the default): the reset makes getrusage, a parent's wait4, /usr/bin/time -v "
                "and VmHWM pollers report a window's peak, not the job's (cgroup peaks and Slurm's accounting "
                "are unaffected); peak_source='edges' or RANKMEM_PEAK_SOURCE=edges leaves them true")
    if scope == "edges":
        return "peak source: edges: VmHWM is left alone, so getrusage, wait4, time -v and VmHWM pollers stay true"
    return f"peak source: {scope}: rankmem writes no clear_refs here"


def cgroup_line(limit: int | None, used: int | None) -> str:
    from rankmem.probe.procfs import own_cgroup_files

    files = own_cgroup_files()
    if files is None:
        return "cgroup: none found (no container memory limit is reported)"
    where = f"v{files.version} at {files.dir}"
    if limit is None:
        return f"cgroup: {where}, no memory limit"
    return f"cgroup: {where}, limit {_gib(limit)} (used {_gib(used)})"


def out_line(out: str) -> str:
    """Whether the run log, heartbeats and events could be written under ``out``, checked by writing."""
    heartbeat_env = os.environ.get(ENV_DIR)
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        return f"run directory {out}: NOT writable (not a directory: {existing}): choose another --out"
    targets = [existing] + [d for d in (RunDir(out).heartbeat, RunDir(out).events) if os.path.isdir(d)]
    for directory in targets:
        try:
            fd, probe = tempfile.mkstemp(prefix=".rankmem-doctor-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return f"run directory {out}: NOT writable ({exc.strerror}: {directory}): choose another --out"
    created = "" if existing == out else f" (to be created under {existing})"
    line = f"run directory {out}: writable{created}: rankmem.jsonl, heartbeat/ and events/"
    if heartbeat_env:
        line += f"; heartbeats go to $RANKMEM_HEARTBEAT_DIR={heartbeat_env}"
    return line


def _import_failure(module: str) -> str | None:
    """Why ``module`` fails to import (found is not enough: a broken install raises anything), or None."""
    if module == "matplotlib":  # what rankmem plot imports, on the backend it uses
        from rankmem.offline.plot import agg_pyplot

        _, exc = load_optional(agg_pyplot)
    else:
        _, exc = load_optional(lambda: importlib.import_module(module))
    return None if exc is None else f"{type(exc).__name__}: {str(exc)[:120]}"


def extras_found() -> dict[str, dict[str, Any]]:
    """Per extra: the modules it provides that are missing or broken, and the installed ones' versions."""
    found: dict[str, dict[str, Any]] = {}
    for extra, modules, what in EXTRAS:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        broken = [] if missing else [f"{m} ({why})" for m in modules
                                     if m in IMPORTED and (why := _import_failure(m)) is not None]
        versions = {} if missing else {m: _version(m) for m in modules}
        found[extra] = {"installed": not missing and not broken, "missing": missing, "broken": broken,
                        "versions": versions, "for": what}
    return found


def extra_lines(found: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["extras:"]
    for extra, info in found.items():
        what = info["for"]
        if info["broken"]:
            lines.append(f"  {extra:<12} broken: {', '.join(info['broken'])} is installed but does not import; "
                         f"reinstall it (pip install --force-reinstall 'rankmem[{extra}]') for {what}")
        elif info["installed"]:
            versions = ", ".join(f"{m} {v or '(version unknown)'}" for m, v in info["versions"].items())
            lines.append(f"  {extra:<12} ok ({versions}): {what}")
        elif extra in NO_HINT:
            lines.append(f"  {extra:<12} not installed: nothing to install here; {what}")
        else:
            lines.append(f"  {extra:<12} missing {', '.join(info['missing'])}: pip install 'rankmem[{extra}]' for "
                         f"{what}")
    return lines


def run(args: argparse.Namespace) -> int:
    lines = [f"rankmem: {__version__} at {_PACKAGE_DIR} "
             f"(python {sys.version.split()[0]})"]
    text, torch = torch_line()
    lines.append(text)
    device = device_lines(torch, args.init_device)
    lines += device
    attribution = attribution_lines(torch)
    lines += attribution
    host, scope = host_lines()
    lines += host
    out = out_line(args.out)
    lines.append(out)
    found = extras_found()
    lines += extra_lines(found)
    if args.json:
        print(json.dumps({
            "rankmem": __version__, "package_dir": _PACKAGE_DIR, "python": sys.version.split()[0],
            "torch": None if torch is None else str(torch.__version__),
            "torch_cuda": None if torch is None else getattr(torch.version, "cuda", None),
            "device": device, "attribution": attribution, "peak_rss_scope": scope, "host": host[1], "cgroup": host[2],
            "run_dir": {"path": args.out, "writable": ": writable" in out, "line": out},
            "extras": found, "lines": lines,
        }, indent=1))
        return 0
    print("\n".join(lines))
    return 0
