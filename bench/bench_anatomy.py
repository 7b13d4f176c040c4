"""What the always-on peak anatomy costs per collect: the same loop with and without ``Monitor.track``.

A model of 1,000 parameter tensors with AdamW state; each step is one phase with two micro-batches of
gradient accumulation (the gradients set by hand, or with ``backward`` made by a backward of the sum of
the parameters' sums), an optimizer step and ``zero_grad``, then a collect.
Timed per step: every call into the monitor (the windows' edges, ``micro_batch``, the collect) and the
optimizer hooks ``track`` registers (between a hook registered before it and one after it, so the
optimizer's own step, ~50-300 ms for 1,000 tensors on this CPU, stays out of the figure). The arms run
interleaved in rounds; the difference of their median telemetry per step is the anatomy's cost. Also
timed alone: one gradient walk. CPU time of the training thread (``thread_time``), not wall time: on a
shared machine a preempted step would count another process's time.

    python bench/bench_anatomy.py [rounds] [backward]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

import rankmem

TENSORS = 1000
STEPS = 30
BACKWARD = "backward" in sys.argv[2:]


class Clock:
    """Seconds of telemetry in the current step: the monitor's calls and the hooks between two marks."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._t = 0.0

    def start(self, *_: Any) -> None:
        self._t = time.thread_time()

    def stop(self, *_: Any) -> None:
        self.spent += time.thread_time() - self._t


def arm(track: bool) -> tuple[rankmem.Monitor, list[torch.nn.Parameter], torch.optim.Optimizer, Clock]:
    params = [torch.nn.Parameter(torch.randn(256)) for _ in range(TENSORS)]
    optimizer = torch.optim.AdamW(params, fused=True)
    monitor = rankmem.Monitor(device="cpu", children=False, near_oom_watch=False, leak_check=False)
    clock = Clock()
    optimizer.register_step_pre_hook(clock.start)
    optimizer.register_step_post_hook(clock.start)
    if track:
        monitor.track(torch.nn.ParameterList(params), optimizer)
    optimizer.register_step_pre_hook(clock.stop)
    optimizer.register_step_post_hook(clock.stop)
    return monitor, params, optimizer, clock


def timed(clock: Clock, fn: Any, *args: Any) -> Any:
    t0 = time.thread_time()
    out = fn(*args)
    clock.spent += time.thread_time() - t0
    return out


def steps(monitor: rankmem.Monitor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
          clock: Clock, start: int) -> list[float]:
    grads = [torch.ones(256) for _ in params]
    spent = []
    for step in range(start, start + STEPS):
        clock.spent = 0.0
        window, phase = monitor.step(step), monitor.phase("update")
        timed(clock, window.__enter__)
        timed(clock, phase.__enter__)
        for _ in range(2):
            timed(clock, monitor.micro_batch, 128)
            if BACKWARD:
                torch.stack([p.sum() for p in params]).sum().backward()
            for p, g in zip(params, grads, strict=True):
                if p.grad is None:
                    p.grad = g.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timed(clock, phase.__exit__, None, None, None)
        timed(clock, window.__exit__, None, None, None)
        timed(clock, monitor.collect)
        spent.append(clock.spent)
    return spent


def main(rounds: int = 5) -> None:
    torch.set_num_threads(1)
    arms = {track: arm(track) for track in (False, True)}
    medians: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):
        for track in (False, True) if r % 2 == 0 else (True, False):
            spent = steps(*arms[track], start=r * STEPS)
            if r:  # the first round warms both up (the optimizer's state appears)
                medians[track].append(statistics.median(spent))
    off, on = statistics.median(medians[False]), statistics.median(medians[True])
    tracker = arms[True][0].tracker
    assert tracker is not None
    for p in arms[True][1]:
        p.grad = torch.ones(256)
    t0 = time.thread_time()
    for _ in range(100):
        tracker.grads(fresh=True)
    walk = (time.thread_time() - t0) / 100
    print(f"{TENSORS} parameter tensors + AdamW state, 2 micro-batches a step (gradients "
          f"{'by backward' if BACKWARD else 'set by hand'}), {rounds} rounds of {STEPS} steps")
    print(f"telemetry per step + collect without track(): {off * 1e3:.3f} ms (median of round medians)")
    print(f"telemetry per step + collect with track():    {on * 1e3:.3f} ms")
    print(f"anatomy per collect: {(on - off) * 1e3:+.3f} ms; one gradient walk: {walk * 1e6:.0f} us")
    for monitor, *_ in arms.values():
        monitor.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
