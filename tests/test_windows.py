"""The windows layer on its own: edges, nesting, merging, numbering and a failure inside a window.

Host figures come from the real Linux probe against memory this test allocates and touches; device
figures from :class:`rankmem.testing.FakeCuda` (no GPU here), whose allocator the test drives.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from rankmem.core.guard import Guard
from rankmem.core.records import WindowBytes
from rankmem.errors import RankmemError
from rankmem.probe.device import select_backend
from rankmem.probe.host import LinuxHostProbe
from rankmem.testing import FakeCuda
from rankmem.windows import Where, Windows

MIB = 1 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the real probe reads /proc")


def _touch(mib: int) -> np.ndarray:
    block = np.ones(mib * MIB, dtype=np.uint8)  # ones, not zeros: every page written, so resident
    return block


class _Recorder:
    """A listener that keeps what it is told."""

    def __init__(self) -> None:
        self.edges: list[tuple[Where, bool]] = []
        self.failures: list[tuple[BaseException, Where, WindowBytes]] = []

    def edge(self, step: int | None, phase: str | None, rss: int | None, failing: bool = False) -> None:
        self.edges.append((Where(step, phase), failing))

    def failed(self, exc: BaseException, where: Where, window: WindowBytes) -> None:
        self.failures.append((exc, where, window))


def _windows(cuda: Any = None, listener: Any = None) -> Windows:
    device = select_backend("cuda", cuda) if cuda is not None else None
    return Windows(LinuxHostProbe(children=False), device, Guard(), listener=listener)


@linux_only
def test_a_phase_peak_is_what_ran_inside_it_and_the_step_holds_it_too() -> None:
    windows = _windows()
    with windows.step(0):
        with windows.phase("quiet"):
            pass
        with windows.phase("loud"):
            block = _touch(96)
            del block
    window, phases = windows.take()
    assert window.peak_rss is not None and window.rss is not None
    loud, quiet = phases["loud"], phases["quiet"]
    assert loud.peak_rss is not None and quiet.peak_rss is not None
    # The 96 MiB existed inside "loud" only: its peak stands above the quiet phase's by about that much.
    assert 90 * MIB <= loud.peak_rss - quiet.peak_rss <= 110 * MIB
    assert window.peak_rss >= loud.peak_rss
    assert loud.rss_delta is not None and abs(loud.rss_delta) < 16 * MIB  # freed before the phase ended
    windows.host.close()


class _Split:
    """An attribution that hands out a fixed split, as the attribution thread would have left it."""

    def __init__(self) -> None:
        self.filled: list[list[str]] = []

    def fill(self, window: WindowBytes, phases: dict[str, Any]) -> None:
        window.device_nontorch = 5 * MIB
        self.filled.append(sorted(phases))


@linux_only
def test_a_take_adds_the_attributions_split_once() -> None:
    split = _Split()
    windows = Windows(LinuxHostProbe(children=False), None, Guard(), attribution=split)  # type: ignore[arg-type]
    with windows.step(0):
        with windows.phase("update"):
            pass
    window, _ = windows.take()
    assert window.device_nontorch == 5 * MIB and split.filled == [["update"]]
    windows.take()
    assert split.filled == [["update"], []]  # every take, the phases of that take only
    windows.host.close()


@linux_only
def test_the_next_step_does_not_remember_this_ones_peak() -> None:
    windows = _windows()
    with windows.step(0):
        block = _touch(128)
        del block
    first, _ = windows.take()
    with windows.step(1):
        pass
    second, _ = windows.take()
    assert first.peak_rss is not None and second.peak_rss is not None
    assert first.peak_rss - second.peak_rss >= 120 * MIB  # reset at the edge
    assert second.lifetime_peak_rss is not None and second.lifetime_peak_rss >= first.peak_rss
    windows.host.close()


@linux_only
def test_a_nested_phase_counts_in_the_phase_around_it() -> None:
    windows = _windows()
    with windows.step(0):
        with windows.phase("outer"):
            with windows.phase("inner"):
                block = _touch(64)
                del block
    _, phases = windows.take()
    outer, inner = phases["outer"], phases["inner"]
    assert inner.peak_rss is not None and outer.peak_rss is not None
    assert outer.peak_rss >= inner.peak_rss
    windows.host.close()


def test_steps_closed_before_a_take_merge_max_peaks_and_summed_events() -> None:
    cuda = FakeCuda(total=1 << 30)
    windows = _windows(cuda)
    with windows.step(0):
        big = cuda.malloc(300 * MIB)
        cuda.free(big)
    with windows.step(1):
        small = cuda.malloc(10 * MIB)
    window, _ = windows.take()
    assert window.peak_allocated is not None and window.allocated is not None
    assert window.peak_allocated >= 300 * MIB  # step 0's peak survives the merge
    assert 10 * MIB <= window.allocated < 11 * MIB  # the current values are the later step's
    cuda.free(small)
    with windows.step(2):
        pass
    after, _ = windows.take()
    assert after.peak_allocated is not None and after.peak_allocated < 300 * MIB
    windows.host.close()


def test_alloc_retries_are_counted_in_the_window_they_happen_in() -> None:
    cuda = FakeCuda(total=1 << 30)
    windows = _windows(cuda)
    held = cuda.malloc(600 * MIB)
    cuda.free(held)  # 600 MiB stays cached: the next large request must release it first (a retry)
    with windows.step(0):
        again = cuda.malloc(700 * MIB)
    window, _ = windows.take()
    assert window.alloc_retries == 1 and window.ooms == 0
    cuda.free(again)
    with windows.step(1):
        pass
    quiet, _ = windows.take()
    assert quiet.alloc_retries == 0
    windows.host.close()


def test_step_numbers_are_owned_here() -> None:
    windows = _windows()
    assert windows.next_step(None) == (0, False)  # counted
    with windows.step(7):
        pass
    assert windows.next_step(None) == (7, True)  # the numbered step closed
    windows.set_step(11)
    assert windows.next_step(None) == (11, True)
    assert windows.next_step(None) == (3, False)  # back to the collect count
    assert windows.next_step(42) == (42, True)
    with pytest.raises(RankmemError, match="integer"):
        with windows.step(1.5):  # type: ignore[arg-type]
            pass
    windows.host.close()


def test_a_failure_inside_a_window_is_told_with_its_figures_and_re_raised_unchanged() -> None:
    cuda = FakeCuda(total=1 << 30)
    recorder = _Recorder()
    windows = _windows(cuda, recorder)
    error = RuntimeError("boom")
    with pytest.raises(RuntimeError) as caught:
        with windows.step(5):
            with windows.phase("update"):
                cuda.malloc(200 * MIB)
                raise error
    assert caught.value is error
    # Told once per window the exception left, innermost first, each naming where it happened.
    assert [(f[1].step, f[1].phase) for f in recorder.failures] == [(5, "update"), (5, None)]
    assert all(f[0] is error for f in recorder.failures)
    figures = recorder.failures[0][2]
    assert figures.peak_allocated is not None and figures.peak_allocated >= 200 * MIB
    assert any(failing for _, failing in recorder.edges)
    assert windows.where.phase is None  # the phase stack unwound
    windows.host.close()


def test_a_bad_phase_name_is_one_clear_error() -> None:
    windows = _windows()
    with pytest.raises(RankmemError, match=r"phase name must match"):
        with windows.phase("a b"):
            pass
    windows.host.close()


def test_three_steps_before_a_take_carry_the_first_ones_peak_and_sum_every_retry() -> None:
    cuda = FakeCuda(total=1 << 30)
    windows = _windows(cuda)
    for step, mib in enumerate((300, 20, 40)):
        held = cuda.malloc(600 * MIB)
        cuda.free(held)  # cached: the next large request must release it first (a retry)
        with windows.step(step):
            block = cuda.malloc(700 * MIB if step == 0 else mib * MIB)
            cuda.free(block)
    window, _ = windows.take()
    assert window.peak_allocated is not None and window.peak_allocated >= 700 * MIB  # step 0's, two merges back
    assert window.alloc_retries == 1  # step 0's retry survives both merges
    assert window.ooms == 0
    windows.host.close()


class _Broken:
    """A host probe whose edge fails (a /proc that vanished): the windows must go on."""

    peak_scope = "window"

    def edge(self) -> tuple[int | None, int | None]:
        raise OSError("/proc vanished")

    def read(self, process: bool = True) -> Any:
        raise OSError("/proc vanished")

    def close(self) -> None:
        pass


def test_a_failing_probe_and_a_failing_listener_warn_once_and_never_raise() -> None:
    class Raising(_Recorder):
        def edge(self, step: int | None, phase: str | None, rss: int | None, failing: bool = False) -> None:
            super().edge(step, phase, rss, failing)
            raise ValueError("disk full")

    listener = Raising()
    guard = Guard()
    with pytest.warns(RuntimeWarning) as caught:
        windows = Windows(_Broken(), None, guard, listener=listener)  # type: ignore[arg-type]
        for step in range(3):
            with windows.step(step), windows.phase("update"):
                pass
        window, phases = windows.take()
    assert window.rss is None and window.peak_rss is None and phases["update"].peak_rss is None
    assert [w.step for w, _ in listener.edges[-4:]] == [2, 2, 2, 2]  # told at every edge all the same
    assert [w.phase for w, _ in listener.edges[-4:]] == [None, "update", "update", None]
    messages = [str(w.message) for w in caught]
    assert sum("memory probe failed" in m for m in messages) == 1  # once per topic, not per edge
    assert sum("heartbeat failed" in m for m in messages) == 1
    assert guard.failures > 10
