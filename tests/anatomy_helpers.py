"""A device for the anatomy tests: rankmem.testing.FakeCuda fed by this process's real CPU tensors.

:class:`Mirror` is a dispatch mode that allocates every new tensor storage on a :class:`TensorCuda`
(torch's caching allocator, faithfully faked) and frees it when the storage dies, as MemTracker
tracks storages. The fake's ``allocated``/``peak_allocated`` are then the live tensor bytes of a real
training loop (each rounded up to 512 B as on a GPU), and the mirror keeps the ground truth the
monitor is checked against: the gradient bytes alive at the instant of each window's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rankmem.testing import FakeCuda


class TensorCuda(FakeCuda):
    """A FakeCuda whose tensors are CPU tensors: ``Monitor.track`` counts the model's CPU tensors as
    the device's (``tensor_device_type``)."""

    tensor_device_type = "cpu"


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's state tensors of dimension >= 1 (AdamW's moments, not its step count)."""
    if optimizer is None:
        return 0
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() >= 1)


class Mirror(TorchDispatchMode):
    """Mirror storages onto ``cuda``; since the last :meth:`mark`, the :attr:`peak` of allocated bytes and
    the gradient and optimizer bytes alive at its first instant (``truth``)."""

    def __init__(self, cuda: TensorCuda, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.cuda, self.params = cuda, params
        self.optimizer: torch.optim.Optimizer | None = None
        self._live: dict[int, tuple[Any, int]] = {}
        self.peak = 0
        self.truth = (0, 0)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages made before the mode was entered (the model's parameters)."""
        for t in tensors:
            self._add(t.untyped_storage())

    def _add(self, storage: Any) -> None:
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._live:
            return
        handle = self.cuda.malloc(storage.nbytes())
        self._live[ptr] = (weakref.ref(storage, lambda _, p=ptr: self._free(p)), handle)
        allocated = self.cuda.memory_allocated()
        if allocated > self.peak:
            self.peak, self.truth = allocated, (grad_bytes(self.params), optimizer_bytes(self.optimizer))

    def _free(self, ptr: int) -> None:
        entry = self._live.pop(ptr, None)
        if entry is not None:
            self.cuda.free(entry[1])

    def mark(self) -> None:
        self.peak = self.cuda.memory_allocated()
        self.truth = (grad_bytes(self.params), optimizer_bytes(self.optimizer))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._add(t.untyped_storage())
        return out
