"""Probe cost per call: the host probe against psutil, the device read against torch.cuda's own calls.

    python bench/bench_probe.py            # --quick: fewer repetitions (a smoke run)
    python bench/bench_probe.py windows    # the windows table alone

Prints microseconds per call (the best of interleaved rounds) and the ratio to a baseline measured in
the same run. Targets: the host window pair (current RSS + window peak, with its reset) at most 10 us;
on a GPU, a whole window edge (host + device read + both peak resets) under 25 us.

Four tables:
1. host: rankmem's /proc reads against ``psutil.Process().memory_info()``;
2. children: a rank holding 256 MiB with 4 forked workers that touch 32 MiB each: the per-collect
   child RSS read against the USS pass the refresh thread makes every ``children_refresh_s`` (what
   ``mem/host/children_uss_gib`` costs, off the training thread) and psutil's USS;
3. stats shape (CPU, any machine): what ``torch.cuda.memory_stats()`` costs over the nested dict it
   flattens, on a dict of the real shape (~120 keys, from ``rankmem.testing.FakeCuda``);
4. device (CUDA GPU only, after initialising CUDA: before, every read is empty and would time
   nothing): the nested-stats read and the edge against ``torch.cuda.memory_allocated()``.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

from rankmem.probe.host import LinuxHostProbe

QUICK = "--quick" in sys.argv
REPEAT = 2000 if QUICK else 20000
ROUNDS = 2 if QUICK else 5


def per_call_us(fn: Callable[[], object], n: int = REPEAT, clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    for _ in range(n):
        fn()
    return (clock() - start) / n * 1e6


def table(cases: dict[str, Callable[[], object]], baseline: str, n: int = REPEAT, rounds: int = ROUNDS,
          clock: Callable[[], float] = time.perf_counter) -> None:
    best = {name: float("inf") for name in cases}
    for _ in range(rounds):  # interleaved rounds; the best of each is the least disturbed
        for name, fn in cases.items():
            best[name] = min(best[name], per_call_us(fn, n, clock))
    unit = "CPU us" if clock is time.thread_time else "us/call"
    print(f"{'case':58s} {unit:>9s} {'vs baseline':>12s}")
    for name, us in best.items():
        print(f"{name:58s} {us:9.2f} {us / best[baseline]:11.2f}x")


def ratio_table(cases: dict[str, Callable[[], object]], baseline: str, n: int, rounds: int) -> None:
    """This thread's CPU time per call, and each case's ratio to the baseline's in the same round: the
    median and IQR over rounds (a neighbour's load weighs on a round's cases alike)."""
    got: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            got[name].append(per_call_us(fn, n, time.thread_time))
    ratios = {name: [us / base for us, base in zip(got[name], got[baseline], strict=True)] for name in cases}

    def spread(xs: list[float], form: str) -> str:
        q = statistics.quantiles(xs, n=4)
        return f"{statistics.median(xs):{form}} ({q[0]:{form}}-{q[2]:{form}})"

    print(f"load {os.getloadavg()[0]:.1f}; {rounds} rounds of {n}: median (IQR)")
    print(f"{'case':58s} {'CPU us/call':>22s} {'vs baseline':>22s}")
    for name in cases:
        print(f"{name:58s} {spread(got[name], '6.2f'):>22s} {spread(ratios[name], '5.2f'):>22s}")


def host_cases() -> None:
    probe = LinuxHostProbe(children=True, children_refresh_s=5.0)
    proc = psutil.Process()

    def window_pair() -> None:  # what every window edge of the Monitor does on the host
        probe.rss_and_peak()
        probe.reset_peak()

    print("host (baseline: psutil.Process().memory_info())")
    table(
        {
            "rankmem rss (statm pread)": probe.rss,
            "rankmem current + window peak + reset": window_pair,
            "rankmem full host read (+children, node, cgroup)": probe.read,
            "psutil.Process().memory_info()": proc.memory_info,
            "psutil.virtual_memory()": psutil.virtual_memory,
        },
        "psutil.Process().memory_info()",
    )
    probe.close()


def window_cases() -> None:
    """An empty step window through the Monitor (heartbeat on) against its kernel floor: two edges
    of a status pread, its parse and a clear_refs write, done by hand with nothing around them.

    Timed as this thread's CPU time (``time.thread_time``) over many short rounds: the ratio is the
    training thread's cost, and on a shared machine wall time holds every preemption by a neighbour."""
    import re
    import tempfile

    import rankmem

    hwm_rss = re.compile(rb"\nVmHWM:\s*(\d+) kB\nVmRSS:\s*(\d+) kB").search
    status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)

    def floor_edges() -> None:  # the least Python a parse takes: one search, two int()
        for _ in range(2):
            found = hwm_rss(os.pread(status, 4096, 0))
            int(found[1]), int(found[2])  # type: ignore[index]
            os.write(clear, b"5")

    with tempfile.TemporaryDirectory() as out:
        monitor = rankmem.Monitor(out_dir=out, sinks=(), device="cpu", children=False, near_oom_watch=False,
                                  leak_check=False)

        def empty_step() -> None:
            with monitor.step():
                pass

        numbers = iter(range(1 << 62))

        def numbered_step() -> None:  # a new step number at every step, as a training loop's
            with monitor.step(next(numbers)):
                pass

        def empty_phase_in_step() -> None:
            with monitor.step(), monitor.phase("update"):
                pass

        def phase_told_four_micro_batches() -> None:  # the work fields: what Monitor.micro_batch adds
            with monitor.step(), monitor.phase("update"):
                for tokens in (2048, 1990, 2011, 1730):
                    monitor.micro_batch(tokens, sequences=40, sq_tokens=tokens * 90)

        print("\nwindows (baseline: two kernel-floor edges; target: the empty step window within 1.30x)")
        ratio_table({"two floor edges (status pread + parse + clear_refs write)": floor_edges,
                     "empty step window (Monitor.step, heartbeat on)": empty_step,
                     "the same, numbered (step(n), n rising)": numbered_step,
                     "empty phase in a step (four edges)": empty_phase_in_step,
                     "the same, told 4 micro-batches (work fields)": phase_told_four_micro_batches},
                    "two floor edges (status pread + parse + clear_refs write)", n=REPEAT // 20,
                    rounds=ROUNDS * 5)
        monitor.close()
    os.close(status)
    os.close(clear)


def children_cases(workers: int = 4, parent_mib: int = 256, worker_mib: int = 32) -> None:
    import numpy as np

    held = np.ones(parent_mib << 20, dtype=np.uint8)
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # a dataloader worker: its own memory, then wait
            own = np.ones(worker_mib << 20, dtype=np.uint8)
            os.write(ready_w, b"x")
            os.read(release_r, 1)
            del own
            os._exit(0)
        pids.append(pid)
    for _ in range(workers):
        os.read(ready_r, 1)
    try:
        probe = LinuxHostProbe(children=True, children_refresh_s=3600.0)
        probe.children_rss()  # lists the children once
        probe.children_uss()  # the first pass; the thread then sleeps for an hour
        uss = probe._children_uss
        assert uss is not None
        kids = [psutil.Process(pid) for pid in pids]

        def psutil_uss() -> int:
            return sum(int(k.memory_full_info().uss) for k in kids)

        print(f"\nchildren: {workers} forked workers of a {parent_mib} MiB rank, {worker_mib} MiB each "
              "(baseline: the per-collect child RSS read)")
        table(
            {
                "children RSS (statm pread per child, every collect)": probe.children_rss,
                "children USS pass (smaps_rollup per child, refresh thread)": uss._pass,
                "psutil memory_full_info().uss per child": psutil_uss,
                "full host read with both (training thread, per collect)": probe.read,
            },
            "children RSS (statm pread per child, every collect)",
            n=max(REPEAT // 200, 20),
        )
        print(f"children USS {probe.children_uss() / 2**20:.1f} MiB, RSS {probe.children_rss() / 2**20:.1f} MiB "
              f"(the workers added {workers * worker_mib} MiB)")
        probe.close()
    finally:
        os.write(release_w, b"x" * workers)
        for pid in pids:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)
        del held


def flatten(nested: dict[str, Any]) -> dict[str, Any]:
    """Nested stats to sorted ``a.b.c`` keys: the work ``torch.cuda.memory_stats()`` does in Python."""
    items: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        else:
            items.append((prefix, value))

    walk("", nested)
    items.sort()
    return collections.OrderedDict(items)


def stats_shape_cases() -> None:
    from rankmem.probe.device import DeviceBackend
    from rankmem.testing import FakeCuda

    cuda = FakeCuda()
    held = [cuda.malloc(n) for n in (1000, 5 << 20, 300 << 20)]
    nested = cuda.memory_stats_as_nested_dict(0)
    n_keys = len(flatten(nested))

    def read_nested() -> tuple[Any, ...]:  # the figures rankmem takes, straight from the nested dict
        a, r = nested["allocated_bytes"]["all"], nested["reserved_bytes"]["all"]
        return (a["current"], a["peak"], r["current"], r["peak"], nested["inactive_split_bytes"]["all"]["current"],
                nested["num_alloc_retries"], nested["num_ooms"])

    def read_flat() -> tuple[Any, ...]:  # the same figures through the flattened dict
        s = flatten(nested)
        return (s["allocated_bytes.all.current"], s["allocated_bytes.all.peak"], s["reserved_bytes.all.current"],
                s["reserved_bytes.all.peak"], s["inactive_split_bytes.all.current"], s["num_alloc_retries"],
                s["num_ooms"])

    class FlatOnly(FakeCuda):  # an accelerator module without the nested form: rankmem's fallback path
        memory_stats_as_nested_dict = None  # type: ignore[assignment]

        def memory_stats(self, device: Any = None) -> dict[str, Any]:
            return flatten(FakeCuda.memory_stats_as_nested_dict(self, device))

    flat_cuda = FlatOnly()
    flat_cuda.malloc(1 << 20)
    print(f"\nstats shape, CPU ({n_keys}-key stats as on a GPU; baseline: the figures read from the nested dict)")
    table(
        {
            "figures from the nested dict (rankmem's path)": read_nested,
            f"flatten {n_keys} keys + read (torch.cuda.memory_stats path)": read_flat,
            "rankmem read, FakeCuda nested (builds the dict in Python)": DeviceBackend("cuda", cuda).read,
            "rankmem read, flat fallback (builds + flattens)": DeviceBackend("cuda", flat_cuda).read,
        },
        "figures from the nested dict (rankmem's path)",
        n=REPEAT // 4,
    )
    for h in held:
        cuda.free(h)


def device_cases() -> None:
    """On a GPU, with CUDA initialised and a context on the current device (as in training)."""
    try:
        import torch
    except ImportError:
        print("\ndevice: torch is not installed; device rows skipped")
        return
    if not torch.cuda.is_available():
        print("\ndevice: no CUDA GPU here; device rows skipped (scripts/gpu_check.sh runs them on one)")
        return
    import rankmem
    from rankmem.probe.device import select_backend

    torch.cuda.set_device(0)
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    backend = select_backend("cuda")
    assert backend is not None and backend.read().total is not None, "the device read is empty: CUDA not initialised"
    monitor = rankmem.Monitor(sinks=(), device="cuda", children=False, leak_check=False)
    index = torch.cuda.current_device()
    nested_stats: Callable[[int], object] | None = getattr(torch._C, "_cuda_memoryStats", None)

    def edge() -> None:
        backend.read()
        backend.reset_peaks()

    cases: dict[str, Callable[[], object]] = {
        "torch.cuda.memory_allocated()": torch.cuda.memory_allocated,
        "torch.cuda.memory_stats() (flattens the dict)": torch.cuda.memory_stats,
        "torch.cuda.mem_get_info(i)": lambda: torch.cuda.mem_get_info(index),
        "torch.cuda.reset_peak_memory_stats(i)": lambda: torch.cuda.reset_peak_memory_stats(index),
        "rankmem device read (nested stats + mem_get_info)": backend.read,
        "rankmem device edge (read + peak reset)": edge,
        "rankmem window edge (host + device, Windows._edge)": monitor._windows._edge,
    }
    if nested_stats is not None:
        cases["torch._C._cuda_memoryStats(i) (nested, one call)"] = lambda: nested_stats(index)
    host_stats: Callable[[], object] | None = getattr(torch._C, "_cuda_hostMemoryStats", None)
    if host_stats is not None:  # the pinned-memory read each device read adds
        cases["torch._C._cuda_hostMemoryStats() (pinned, nested)"] = host_stats
    print(f"\ndevice: {backend.device_name()} (baseline: torch.cuda.memory_allocated())")
    table(cases, "torch.cuda.memory_allocated()", n=REPEAT // 10)
    monitor.close()
    del held


def main() -> None:
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench_probe measures the Linux /proc probe")
    host_cases()
    window_cases()
    children_cases()
    stats_shape_cases()
    device_cases()


if __name__ == "__main__":
    window_cases() if "windows" in sys.argv else main()
