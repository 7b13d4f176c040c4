"""The background publisher: records reach the sinks without waking the thread per collect, a filling
queue wakes it, a stalled sink never blocks the caller (drop-oldest, counted, one warning)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from rankmem._collective import Gathered
from rankmem._guard import Guard
from rankmem._publish import Publisher
from rankmem._records import RunHeader, StepRecord


class Recorder:
    """A sink that records the steps it was given; ``gate`` (when set) holds every write until opened."""

    def __init__(self, expect: int, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.gate = gate
        self.expect = expect
        self.done = threading.Event()
        self.entered = threading.Event()

    def open(self, header: RunHeader) -> None:
        pass

    def write(self, record: StepRecord) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        self.steps.append(record.step)
        if len(self.steps) >= self.expect:
            self.done.set()

    def close(self) -> None:
        pass


def _gathered(value: float) -> Gathered:
    return Gathered(["loss"], np.array([[value]]), {"loss/max": value}, mixed=False)


def _header() -> RunHeader:
    return RunHeader(world_size=1, ranks=[], config={}, started=0.0)


def test_a_record_reaches_the_sink_without_a_flush() -> None:
    sink = Recorder(expect=1)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.POLL_S = 0.05
    publisher.open(_header())
    publisher.publish(7, 0.0, _gathered(1.0))
    assert sink.done.wait(30)  # the thread found it on its own: nothing woke it
    assert sink.steps == [7]
    publisher.close()


def test_a_half_full_queue_wakes_the_thread() -> None:
    n = Publisher.MAX_PENDING // 2 + 1  # the header counts as one pending item
    sink = Recorder(expect=n)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.POLL_S = 3600.0  # without the wake, nothing would be written within the test's life
    publisher.open(_header())
    for step in range(n):
        publisher.publish(step, 0.0, _gathered(float(step)))
    assert sink.done.wait(30)
    assert sink.steps[:n] == list(range(n))
    publisher.close()


def test_a_stalled_sink_drops_the_oldest_records_and_warns_once() -> None:
    gate = threading.Event()
    sink = Recorder(expect=1, gate=gate)
    publisher = Publisher([sink], leak_check=False, guard=Guard())
    publisher.open(_header())
    publisher.publish(0, 0.0, _gathered(0.0))
    assert sink.entered.wait(30)  # the thread is stuck in the sink with step 0
    assert publisher.flush(0.1) is False
    extra = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, Publisher.MAX_PENDING + extra + 1):
            publisher.publish(step, 0.0, _gathered(float(step)))  # never blocks
    assert publisher.dropped == extra
    assert [str(w.message) for w in caught] == [
        "rankmem: the sinks fall behind the training loop; the oldest pending records are dropped "
        "(Publisher.dropped counts them) rather than blocking training"]
    gate.set()
    assert publisher.flush(30)
    last = Publisher.MAX_PENDING + extra
    assert sink.steps == [0, *range(extra + 1, last + 1)]
    publisher.close()


@pytest.mark.parametrize("background", [True, False])
def test_close_writes_what_is_pending(background: bool) -> None:
    sink = Recorder(expect=3)
    publisher = Publisher([sink], leak_check=False, guard=Guard(), background=background)
    publisher.POLL_S = 3600.0
    publisher.open(_header())
    for step in range(3):
        publisher.publish(step, 0.0, _gathered(float(step)))
    publisher.close()
    assert sink.steps == [0, 1, 2]
