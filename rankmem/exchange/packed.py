"""The packed transport: every rank's values in one float64 vector, one all-gather.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankmem.core.warnings import WarnOnce
from rankmem.exchange.dist import _all_gather_single, _check_local_device, all_gather_objects, dist_active

_SIG_MASK = (1 << 52) - 1  # a float64 holds integers up to 2**53 exactly


Schema = tuple[Any, ...]
"""A rank's value layout: its sorted keys (with lengths, for lists); equal layouts pack equally."""


def schema_signature(schema: Schema) -> float:
    """A 52-bit checksum of the key layout, exact in a float64, equal on every rank for equal layouts."""
    text = repr(schema).encode()
    return float(((zlib.adler32(text) << 32) | zlib.crc32(text)) & _SIG_MASK)


class PackedGather:
    """Gathers one flat float64 vector per rank in a single ``all_gather_into_tensor``.

    Each rank sends ``[signature, n, step, v_0 .. v_{n-1}, NaN padding]`` of an agreed capacity. Every rank
    receives the same matrix, so all see whether signatures and lengths agree; if not, every rank falls back
    to one pickled gather and raises the capacity for the next call, so disagreement cannot hang. The first
    call always takes the fallback (the capacity starts at 0), which also learns the layout.
    """

    def __init__(
        self, group: Any = None, device_type: str | tuple[str, int] | None = None, device_module: Any = None
    ) -> None:
        self.group = group
        self.device_type = device_type[0] if isinstance(device_type, tuple) else device_type
        """``cuda``/``npu``/``xpu``: the device type for device-only collectives (NCCL, HCCL). The index
        is never fixed here (a pair's index is ignored): it is the current device at each gather."""
        self.device_module = device_module
        """The torch device module whose current device the tensors follow (default ``torch.<type>``)."""
        self.capacity = 0
        self.fallbacks = 0
        self._world = 0  # 0: not resolved yet; a PackedGather serves one process group
        self._backend = ""
        self._on_device = False
        self._where: tuple[str, int | None] | None = None
        self._device: Any = None
        self.warn_once = WarnOnce()
        self._last_schema: Schema | None = None
        self._last_sig = 0.0
        self._width = -1
        self._send: Any = None
        self._staging: Any = None
        self._send_np: np.ndarray = np.empty(0)
        self._out: Any = None
        self._out_np: np.ndarray | None = None  # the output as numpy, where it lives on the CPU

    @property
    def world(self) -> int:
        """The group's size, once :meth:`ready` has resolved it (0 before, or with nothing to gather)."""
        return self._world

    @property
    def device(self) -> Any:
        """The ``torch.device`` the gathers run on, once :meth:`ready` has resolved it."""
        return self._device

    def ready(self) -> bool:
        """Resolve the group (once) and the device (every call); False when there is nothing to gather."""
        return self._setup()

    def signature(self, schema: Schema) -> float:
        """The layout checksum of ``schema``, cached for the steady state (one layout, every step)."""
        if schema != self._last_schema:
            self._last_schema, self._last_sig = schema, schema_signature(schema)
        return self._last_sig

    def _module(self) -> tuple[str, Any] | None:
        return device_module_of(self.device_type, self.device_module)

    def resolve_device(self, backend: str) -> tuple[str, int | None]:
        """``(type, index)`` of the tensors for a group of ``backend``, read now (:func:`device_for`)."""
        return device_for(backend, self.device_type, self.device_module)

    def _follow_device(self) -> None:
        """Put the tensors on the device :meth:`resolve_device` names, moving them when it changed."""
        where = self.resolve_device(self._backend)
        if where == self._where:
            return
        import torch

        kind, index = where
        self._where, self._on_device = where, kind != "cpu"
        self._device = torch.device(kind) if index is None else torch.device(kind, index)
        self._width = -1  # the buffers are rebuilt on the new device
        if index is not None:
            found = self._module()
            count = int(found[1].device_count()) if found is not None else 0
            message = _check_local_device(kind, index, count)
            if message is not None:
                self.warn_once(f"local:{kind}:{index}", message)

    def _setup(self) -> bool:
        """Resolve the group's size once and the tensors' device at every call (the current device
        can change between collects; the check costs ~1 us next to a device collective); False when
        there is nothing to gather."""
        if self._world == 0:
            if not dist_active(self.group):
                return False
            import torch.distributed as dist

            self._world = dist.get_world_size(self.group)
            self._backend = str(dist.get_backend(self.group))
            self._follow_device()
        elif self._on_device:
            self._follow_device()
        return True

    def _buffers(self, width: int) -> None:
        # Reused between calls (reallocated only when the capacity grows): allocation is a visible
        # share of a ~100 us gloo all-gather.
        if width != self._width:
            import torch

            self._width = width
            self._send_np = np.empty(width, dtype=np.float64)
            self._staging = torch.from_numpy(self._send_np)  # shares memory with _send_np
            self._send = self._staging if self._device.type == "cpu" else self._staging.to(self._device)
            self._out = torch.empty(self._world * width, dtype=torch.float64, device=self._device)
            self._out_np = self._out.numpy() if self._device.type == "cpu" else None

    def _gathered(self, schema: Schema, values: Sequence[float], step: float) -> tuple[np.ndarray, list[int]] | int:
        """Pack, one all-gather, check. Every rank's vector as a ranks x width view of the reused output
        buffer (copy what you keep) and each rank's value count; or, when layouts differ or values outgrow
        the capacity, the count the pickled fallback must make room for (every rank returns it alike)."""
        sig = self.signature(schema)
        n, world, width = len(values), self._world, self.capacity + _HEAD
        self._buffers(width)
        send = self._send_np
        send[:_HEAD] = sig, n, step
        send[_HEAD:] = math.nan  # the padding; all of it where the values outgrow the capacity
        if n <= self.capacity:
            send[_HEAD : _HEAD + n] = values
        if self._device.type != "cpu":
            self._send.copy_(self._staging)  # host-to-device
        _all_gather_single(self._out, self._send, self.group)
        out = self._out_np if self._out_np is not None else self._out.cpu().numpy()  # a device-to-host sync on NCCL
        block = out.reshape(world, width)
        # The headers as Python numbers: a few per rank, cheaper to check than through numpy calls.
        head = block[:, :_HEAD].tolist()
        lengths = [int(h[1]) for h in head]
        self._check_steps([h[2] for h in head])
        first = head[0][0]
        # Equal layouts may still carry different numbers of values (per-rank list lengths inside
        # the payload); all that must hold is that every rank's values fit.
        if all(h[0] == first for h in head) and max(lengths) <= self.capacity:
            return block, lengths
        return max(lengths)

    def gather(self, schema: Schema, values: Sequence[float], step: float = math.nan
               ) -> tuple[list[Schema], list[np.ndarray]]:
        """Per rank, its layout and its values. A collective: every rank of the group calls it.

        ``step`` travels in the header: ranks that meet at different steps are named in a warning.
        """
        got = self.gather_matrix(schema, values, step)
        return got if isinstance(got, tuple) else ([schema] * len(got), list(got))

    def gather_matrix(self, schema: Schema, values: Sequence[float], step: float = math.nan
                      ) -> np.ndarray | tuple[list[Schema], list[np.ndarray]]:
        """:meth:`gather`, with the steady state of a :class:`Monitor` made cheap: when every rank sent
        this layout and as many values, one ranks x values matrix (a copy); otherwise what
        :meth:`gather` returns. A collective, like :meth:`gather`."""
        if not self._setup():
            return np.asarray(values, dtype=np.float64).reshape(1, -1)
        got = self._gathered(schema, values, step)
        if isinstance(got, int):
            return self.fallback(schema, values, got)
        block, lengths = got
        n = len(values)
        if all(length == n for length in lengths):
            return block[:, _HEAD : _HEAD + n].copy()
        rows = block.copy()
        return [schema] * len(lengths), [rows[r, _HEAD : _HEAD + k] for r, k in enumerate(lengths)]

    def fallback(self, schema: Schema, values: Sequence[float], need: int
                 ) -> tuple[list[Schema], list[np.ndarray]]:
        """The pickled gather every rank takes together when layouts disagree or values outgrow the
        capacity; ``need`` (the most values any rank sent, known alike on every rank) is the new one."""
        self.fallbacks += 1
        gathered = all_gather_objects((schema, list(map(float, values))), self.group)
        self.capacity = need
        return [g[0] for g in gathered], [np.asarray(g[1], dtype=np.float64) for g in gathered]

    def _check_steps(self, steps: list[float]) -> None:
        """Ranks meeting in one gather at different steps: one of them called collect() more (or fewer)
        times than the others and met its peers' next collect instead of its own. Every rank sees the
        same steps, so every rank says the same thing."""
        known = [s for s in steps if s == s]  # NaN: no step given
        if not known or all(s == known[0] for s in known):
            return
        at: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            if s == s:
                at.setdefault(int(s), []).append(r)
        detail = "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(at.items()))
        self.warn_once("steps", f"ranks met in one collect() at different steps ({detail}): a rank called collect() "
                        "more or fewer times than the others; the last one to call it waits for the process-group "
                        "timeout")


_HEAD = 3
"""The header of each rank's packed vector: layout checksum, value count, the caller's step."""


def device_module_of(device_type: str | None, device_module: Any) -> tuple[str, Any] | None:
    """The device type and module of device tensors; None when there is no device to gather on."""
    if device_module is not None:
        return device_type or "cuda", device_module
    import torch

    if device_type is not None:
        module = getattr(torch, device_type, None)
        return None if module is None else (device_type, module)
    return ("cuda", torch.cuda) if torch.cuda.is_available() else None


def device_for(backend: str, device_type: str | None, device_module: Any) -> tuple[str, int | None]:
    """``(type, index)`` of the tensors for a group of ``backend``, read now: ``("cpu", None)`` for
    gloo and MPI (they gather CPU tensors), else the current device of the device type (NCCL, HCCL
    and XCCL gather device tensors only, on the device the rank set for itself)."""
    backend = backend.lower()
    found = None if "gloo" in backend or "mpi" in backend else device_module_of(device_type, device_module)
    if found is None:
        return "cpu", None
    kind, module = found
    # The first collect is a collective of the rank's own group, after its set_device: reading
    # the current device here (which initialises CUDA) is what the collective itself would do.
    return kind, int(module.current_device())
