"""A faithful fake of ``pynvml`` (nvidia-ml-py) over :class:`rankmem.testing.FakeCuda`'s device.

Re-exported as :class:`rankmem.testing.FakeNvml`; pass it in through the public API
(``Monitor(device_module=cuda, nvml_module=FakeNvml(cuda))``). It mirrors what rankmem calls, with
pynvml's names, signatures, return types, error codes and exceptions (nvidia-ml-py 13.x): calls before
``nvmlInit`` raise ``NVMLError_Uninitialized``; handles by index or UUID (``MIG-<uuid>`` under
``mig=True``); a process is listed only while it holds a context, with ``None`` for a figure the driver
does not know; under MIG the per-process query raises ``mig_refusal``.

This process's figure is the context plus the allocator's reserved bytes plus ``nontorch``; other
processes' bytes, ``managed`` memory and ``nontorch`` join FakeCuda's ``other_process``, so that
``mem_get_info`` sees them too. ``calls`` records every call's name and thread.
"""

from __future__ import annotations

import ctypes
import os
import string
import threading
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_VALUE_NOT_AVAILABLE_ulonglong = ctypes.c_ulonglong(-1)
NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized", NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """pynvml's error: ``NVMLError(code)`` is an instance of that code's subclass, ``.value`` the code."""

    _valClassMapping: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:  # noqa: PYI034 - pynvml's own construction
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _error_classes() -> dict[str, type[NVMLError]]:
    """``NVMLError_NotSupported`` and the others, named as pynvml's ``_extractNVMLErrorsAsClasses`` does."""
    out: dict[str, type[NVMLError]] = {}
    for name, value in list(globals().items()):
        if name.startswith("NVML_ERROR_"):
            class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
            cls = type(class_name, (NVMLError,), {"__new__": _new_of(value)})
            NVMLError._valClassMapping[value] = cls
            out[class_name] = cls
    return out


def _new_of(value: int) -> Any:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = value
        return obj
    return new


_CLASSES = _error_classes()
globals().update(_CLASSES)


class _Process:
    """What pynvml's ``nvmlStructToFriendlyObject`` returns for an ``nvmlProcessInfo`` entry."""

    def __init__(self, pid: int, used: int | None, mig: bool) -> None:
        raw = NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
        self.pid = pid
        self.usedGpuMemory: int | None = None if raw == NVML_VALUE_NOT_AVAILABLE_ulonglong.value else raw
        self.gpuInstanceId = 0 if mig else 0xFFFFFFFF
        self.computeInstanceId = 0 if mig else 0xFFFFFFFF

    def __str__(self) -> str:
        return str(self.__dict__)


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


def _proc_pid() -> int:
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


class FakeNvml:
    """A fake ``pynvml`` module over one :class:`~rankmem.testing.FakeCuda` device (see the module docstring).

    ``own_pid``: the PID the driver reports for this process (default the outermost PID ``/proc`` shows).
    ``mig``: a MIG instance, whose per-process query raises ``NVMLError(mig_refusal)``.
    ``own_not_available``: this process's ``usedGpuMemory`` is ``NVML_VALUE_NOT_AVAILABLE``.
    """

    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_VALUE_NOT_AVAILABLE_ulonglong = NVML_VALUE_NOT_AVAILABLE_ulonglong
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    locals().update({k: v for k, v in globals().items() if k.startswith("NVML_ERROR_")})
    locals().update(_CLASSES)

    def __init__(self, cuda: Any, *, own_pid: int | None = None, nontorch: int = 0, managed: int = 0,
                 mig: bool = False, mig_refusal: int = NVML_ERROR_NO_PERMISSION,
                 own_not_available: bool = False) -> None:
        if len(getattr(cuda, "_devices", ())) != 1:
            raise ValueError("FakeNvml models one FakeCuda device (FakeCuda(devices=1))")
        self.cuda = cuda
        self.own_pid = _proc_pid() if own_pid is None else own_pid
        self.nontorch = nontorch
        self.managed = managed
        self.mig = mig
        self.mig_refusal = mig_refusal
        self.own_not_available = own_not_available
        self.others: dict[int, int | None] = {}
        """Other processes on the device: host PID -> ``usedGpuMemory`` (None: not available)."""
        self.calls: list[tuple[str, int]] = []
        """``(function, thread ident)`` of every call, in order."""
        self._initialised = 0
        self._lock = threading.Lock()
        self._sync()

    # ---- the test's side ---------------------------------------------------------------------------
    def add_process(self, pid: int, used: int | None) -> None:
        """Another process (a sibling rank, an engine worker, another job) holding ``used`` bytes."""
        self.others[pid] = used
        self._sync()

    def remove_process(self, pid: int) -> None:
        self.others.pop(pid, None)
        self._sync()

    def set_managed(self, nbytes: int) -> None:
        self.managed = nbytes
        self._sync()

    def _sync(self) -> None:
        # Device used as cudaMemGetInfo sees it: everything every process holds, managed memory too.
        self.cuda.other_process = sum(v or 0 for v in self.others.values()) + self.managed + self.nontorch

    def threads(self) -> set[int]:
        """The threads that called NVML."""
        return {ident for _name, ident in self.calls}

    # ---- pynvml -------------------------------------------------------------------------------------
    def _call(self, name: str, initialised: bool = True) -> None:
        with self._lock:
            self.calls.append((name, threading.get_ident()))
        if initialised and not self._initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        self._call("nvmlInit", initialised=False)
        self._initialised += 1  # pynvml counts references: each nvmlInit wants an nvmlShutdown

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self._initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._call("nvmlDeviceGetHandleByIndex")
        if index != 0:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(0)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        self._call("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if text != self._uuid():
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle(0)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._call("nvmlDeviceGetUUID")
        return self._uuid()

    def _uuid(self) -> str:
        return ("MIG-" if self.mig else "GPU-") + str(self.cuda.get_device_properties(0).uuid)

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> ctypes.c_uint:
        self._call("nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(1 if self.mig else 0)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._call("nvmlDeviceGetMigMode")
        if self.mig:  # a MIG device handle has no mode of its own
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return [NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE]

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> _Memory:
        self._call("nvmlDeviceGetMemoryInfo")
        free = self.cuda._device_free(0)
        return _Memory(self.cuda.total, free, self.cuda.total - free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[_Process]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        if self.mig:
            raise NVMLError(self.mig_refusal)
        out = []
        if self.cuda.contexts_created.get(0):  # a process is listed while it holds a context
            own = None if self.own_not_available else (
                self.cuda.context + self.cuda.memory_reserved(0) + self.nontorch)
            out.append(_Process(self.own_pid, own, self.mig))
        out += [_Process(pid, used, self.mig) for pid, used in self.others.items()]
        return out

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[_Process]:
        self._call("nvmlDeviceGetGraphicsRunningProcesses")
        if self.mig:
            raise NVMLError(self.mig_refusal)
        return []  # a compute GPU (H100, A100) runs no graphics process
