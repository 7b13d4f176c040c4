"""NVML through its official bindings (``nvidia-ml-py``, imported as ``pynvml``): the one device a rank
uses and the processes that hold memory on it. Every call here runs on the attribution thread
(:mod:`rankmem.probe.nvmlwatch`), never on the training thread: listing processes takes the driver's
global lock for milliseconds (MangoHud#2104), and ``nvidia-smi`` per step made Lightning ~10x slower
(Lightning#189).

Foreign exceptions are translated here, once: an ``NVMLError`` becomes the reason a figure is absent.
pynvml itself turns ``NVML_VALUE_NOT_AVAILABLE`` in ``usedGpuMemory`` into ``None``; it stays ``None``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from rankmem.core.guard import attempt

INSTALL = "pip install 'rankmem[nvml]'"
_UNSUPPORTED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION")


def load(module: Any = None) -> tuple[Any, str | None]:
    """``(pynvml, None)`` initialised, or ``(None, why not)``. ``module`` replaces pynvml (a fake)."""
    if module is None:
        try:
            module = importlib.import_module("pynvml")
        except ImportError:
            return None, f"nvidia-ml-py is not installed: {INSTALL}"
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        return None, f"NVML cannot start: {error_text(module, exc)}"
    except OSError as exc:  # a broken libnvidia-ml.so
        return None, f"NVML cannot start: {exc}"
    return module, None


def error_text(nvml: Any, exc: BaseException) -> str:
    """``Not Supported (NVML_ERROR_NOT_SUPPORTED)``: the error and its constant's name."""
    value = getattr(exc, "value", None)
    names = [n for n in dir(nvml) if n.startswith("NVML_ERROR_") and getattr(nvml, n, None) == value]
    try:
        text = str(exc)
    except nvml.NVMLError:  # pynvml's __str__ asks the library, which may be gone
        text = f"NVML error {value}"
    return f"{text} ({names[0]})" if names else text


def _code_name(nvml: Any, exc: BaseException) -> str | None:
    value = getattr(exc, "value", None)
    return next((n for n in _UNSUPPORTED if getattr(nvml, n, None) == value), None)


def uuid_candidates(module: Any, index: int) -> list[str]:
    """NVML UUIDs the torch device ``index`` may have: ``GPU-<uuid>`` or, for a MIG instance,
    ``MIG-<uuid>``. torch's device properties carry CUDA's UUID without the prefix; NVML's indices
    ignore ``CUDA_VISIBLE_DEVICES``, so the UUID is the join, never the index."""
    props_of = getattr(module, "get_device_properties", None)
    props = None if props_of is None else attempt(props_of, index, default=None)
    uuid = getattr(props, "uuid", None)  # a build without the field
    if uuid is None:
        return []
    bare = str(uuid).removeprefix("GPU-").removeprefix("MIG-")
    return [f"GPU-{bare}", f"MIG-{bare}"]


@dataclass(frozen=True, slots=True)
class Listing:
    """NVML's processes on one device: ``(pid, usedGpuMemory or None)``; or why there is no list."""

    processes: list[tuple[int, int | None]] | None
    refused: str | None = None


class NvmlDevice:
    """One device's handle and the two queries attribution makes of it."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.mig = self._mig()
        """True on a MIG instance or a GPU in MIG mode; None where NVML cannot say."""

    @classmethod
    def open(cls, nvml: Any, uuids: list[str]) -> tuple[NvmlDevice | None, str | None]:
        """The device with one of ``uuids``, or ``(None, why not)``."""
        if not uuids:
            return None, "this torch build gives no device UUID to find the device in NVML by"
        for uuid in uuids:
            try:
                return cls(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid)), None
            except nvml.NVMLError:
                continue
        return None, f"NVML knows no device {uuids[0]} (nor {uuids[1]})" if len(uuids) > 1 else "device not found"

    def _mig(self) -> bool | None:
        nvml = self.nvml
        try:
            if _flag(nvml.nvmlDeviceIsMigDeviceHandle(self.handle)):
                return True
            current, _pending = nvml.nvmlDeviceGetMigMode(self.handle)
            return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))
        except nvml.NVMLError:
            return None  # a GPU without MIG: NVML_ERROR_NOT_SUPPORTED
        except AttributeError:
            return None

    def processes(self) -> Listing:
        """Compute and graphics processes (a process in both appears twice, its figure the same)."""
        nvml = self.nvml
        out: list[tuple[int, int | None]] = []
        for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                listed = getattr(nvml, query)(self.handle)
            except nvml.NVMLError as exc:
                if query.endswith("GraphicsRunningProcesses") and _code_name(nvml, exc):
                    continue  # compute-only GPUs (H100, A100) have no graphics list
                return Listing(None, self._refusal(exc))
            for p in listed:
                used = getattr(p, "usedGpuMemory", None)
                out.append((int(p.pid), None if used is None else int(used)))
        return Listing(out)

    def _refusal(self, exc: BaseException) -> str:
        if self.mig and _code_name(self.nvml, exc):
            return f"per-process figures unsupported under MIG ({error_text(self.nvml, exc)})"
        return f"NVML refused the process list: {error_text(self.nvml, exc)}"


def _flag(value: Any) -> bool:
    """pynvml returns some flags as ``ctypes.c_uint``, not int."""
    return bool(getattr(value, "value", value))
