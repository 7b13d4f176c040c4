"""A test-only allocator recorder: a real CPU (or FakeTensor) run written as CUDA allocator history.

``torch.cuda.memory._record_memory_history`` has no CPU analogue, so this TorchDispatchMode plays the
caching allocator for the storages a model creates: each new storage is a block (its bytes rounded up
to 512, as the CUDA allocator rounds), at an address of its own (a freed block's address is reused by
the next block of the same size, as a cache would), and the storage's death (a weakref callback, as
``MemTracker`` uses) frees it. It emits the entries of torch's ``TraceEntry`` schema: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``oom`` (past ``limit`` bytes, raising
``torch.OutOfMemoryError`` before the block exists), ``snapshot`` (its active bytes, as the allocator
marks every snapshot taken while recording), with the Python ``frames`` innermost first, ``stream``,
``time_us`` and ``user_metadata`` (:meth:`set_metadata` stands in for
``torch.cuda.memory._set_memory_metadata``), into a ring of ``max_entries``.

The true allocated bytes and their peak are counted as the blocks come and go, not from the trace:
the ground truth the replay is held to.
"""

from __future__ import annotations

import collections
import itertools
import sys
import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

_ROUND = 512
_SEGMENT = 2 << 20




class Recorder(TorchDispatchMode):
    def __init__(self, max_entries: int = 1 << 30, limit: int | None = None, granule: int = _ROUND) -> None:
        super().__init__()
        self.granule = granule  # 1: bytes as MemTracker counts them off CUDA
        self.trace: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_entries)
        self.blocks: dict[int, dict[str, Any]] = {}  # addr -> the live block
        self.by_storage: dict[int, int] = {}  # id(storage) -> addr
        self.free_addrs: dict[int, list[int]] = collections.defaultdict(list)
        self.next_addr = itertools.count(1 << 40, _SEGMENT)
        self.metadata = ""
        self.stream = 0
        self.limit = limit
        self.allocated = 0
        self.peak = 0
        self.pending: list[dict[str, Any]] = []  # freed on a side stream: completed at sync()

    # ---- the allocator's side -----------------------------------------------------------------------
    def set_metadata(self, metadata: str) -> None:
        self.metadata = metadata

    def _entry(self, action: str, **fields: Any) -> dict[str, Any]:
        entry = {"action": action, "stream": self.stream, "time_us": time.time_ns() // 1000,
                 "user_metadata": self.metadata, "frames": [], **fields}
        self.trace.append(entry)
        return entry

    def adopt(self, *tensors: torch.Tensor | None) -> None:
        """Blocks that exist before recording (parameters, optimizer state, a batch): live, no entry."""
        for t in tensors:
            if t is not None:
                self._track(t, record=False)

    def _track(self, t: torch.Tensor, record: bool = True) -> None:
        st = t.untyped_storage()
        if id(st) in self.by_storage:
            return
        size = max(self.granule, -(-st.nbytes() // self.granule) * self.granule)
        if record and self.limit is not None and self.allocated + size > self.limit:
            self._entry("oom", size=size, device_free=self.limit - self.allocated)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        reuse = self.free_addrs[size]
        addr = reuse.pop() if reuse else next(self.next_addr)
        frames = _frames()
        if record and not reuse and addr not in self.blocks:
            self._entry("segment_alloc", addr=addr, size=max(size, _SEGMENT))
        self.blocks[addr] = {"address": addr, "size": size, "requested_size": st.nbytes(),
                             "state": "active_allocated", "frames": frames, "stream": self.stream}
        self.by_storage[id(st)] = addr
        weakref.finalize(st, self._free, id(st), addr, size, self.stream)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        if record:
            self._entry("alloc", addr=addr, size=size, frames=frames)

    def _free(self, key: int, addr: int, size: int, stream: int) -> None:
        self.by_storage.pop(key, None)
        block = self.blocks.pop(addr)
        self.allocated -= size
        self._entry("free_requested", addr=addr, size=size, frames=block["frames"], stream=stream)
        done = {"action": "free_completed", "addr": addr, "size": size, "stream": stream,
                "frames": block["frames"]}
        if stream != 0:
            self.pending.append(done)  # the side stream's work is not done yet: the address stays unusable
        else:
            self._complete(done)

    def _complete(self, done: dict[str, Any]) -> None:
        self._entry(done.pop("action"), **done)
        self.free_addrs[done["size"]].append(done["addr"])

    def sync(self) -> None:
        """The side stream's events complete: its freed blocks become reusable."""
        for done in self.pending:
            self._complete(done)
        self.pending = []

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def segments(self) -> list[dict[str, Any]]:
        """``memory_snapshot(include_traces=False)``; leaves a ``snapshot`` entry, as the allocator does."""
        segs = [{"device": 0, "address": b["address"], "total_size": max(b["size"], _SEGMENT),
                 "allocated_size": b["size"], "active_size": b["size"], "stream": b["stream"],
                 "blocks": [dict(b)]} for b in self.blocks.values()]
        self._entry("snapshot", addr=0, size=sum(b["size"] for b in self.blocks.values()))
        return segs

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``."""
        segments = self.segments()
        return {"segments": segments, "device_traces": [list(self.trace)]}

    # ---- the dispatch side --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


def _frames(limit: int = 24) -> list[dict[str, Any]]:
    """The Python stack, innermost first, without this module's and torch's dispatch frames."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        name = frame.f_code.co_filename
        if name != __file__:
            frames.append({"filename": name, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return frames
