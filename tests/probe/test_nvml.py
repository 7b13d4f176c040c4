"""Device used by owner through FakeNvml, driven through the Monitor: every fixture classified, no unknown
figure ever a 0 (vllm-omni#6249), the training thread pays no NVML call, the events carry the split."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rankmem import Monitor
from rankmem.core.events import NearOomEvent
from rankmem.errors import RankmemError
from rankmem.probe.attribution import Owners, split
from rankmem.probe.device import DeviceBackend
from rankmem.probe.nvmlwatch import DeviceAttribution
from rankmem.probe.pidmap import HOST_NAMESPACE, parse_nspid, pid_namespace_inode
from rankmem.testing import FakeCuda, FakeNvml, FakeOutOfMemoryError, NVMLError
from tests.probe.nvml_helpers import KEYS, MIB, fixture, key, mib, run_until_split

NOT_OURS = 3_999_999  # above pid_max's default (4194304 only on 64-bit with a raised limit): no live process

in_host_namespace = pytest.mark.skipif(pid_namespace_inode() != 0xEFFFFFFC,
                                       reason="these fixtures assume the test runs in the host's PID namespace")


def _sleeper() -> subprocess.Popen[bytes]:
    """A real child process standing in for an engine worker."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _assert_absent(out: dict[str, float], parts: tuple[str, ...]) -> None:
    """An unknown figure is no key at all: never a 0 (the bug of vllm-omni#6249)."""
    for part in parts:
        assert key(part) not in out, f"{part} is unknown here, yet reported as {out.get(key(part))}"


@in_host_namespace
def test_the_parts_of_a_full_split_sum_to_device_used_and_the_engine_is_a_descendant() -> None:
    child = _sleeper()
    try:
        cuda, nvml, monitor = fixture(nontorch=100 * MIB, managed=64 * MIB)
        nvml.add_process(child.pid, 700 * MIB)  # the engine: 700 MiB on our device
        nvml.add_process(NOT_OURS, 200 * MIB)  # another job
        out = run_until_split(monitor, nvml, until="mem/phase/rollout/descendants_gib/max")
        monitor.close()
    finally:
        child.kill()
        child.wait(10)
    # Ground truth as the fake was set up: the context (300) and nontorch (100) are this rank's non-torch.
    assert mib(out, "nontorch") == pytest.approx(400)
    assert mib(out, "descendants") == pytest.approx(700)
    assert mib(out, "foreign") == pytest.approx(200)
    assert mib(out, "siblings") == 0  # a real 0: no sibling rank in this job
    assert mib(out, "unattributed") == pytest.approx(64)  # managed memory: in no process's figure
    parts = out["mem/device/reserved_gib/max"] * 1024 + sum(mib(out, p) or 0 for p in KEYS)
    assert parts == pytest.approx(out["mem/device/used_gib/max"] * 1024)
    assert out["mem/phase/rollout/descendants_gib/max"] * 1024 == pytest.approx(700)


@in_host_namespace
def test_a_sleeping_engine_shows_in_the_phase_it_sleeps_through() -> None:
    child = _sleeper()
    try:
        cuda, nvml, monitor = fixture()
        nvml.add_process(child.pid, 2048 * MIB)
        run_until_split(monitor, nvml, phase="rollout", until="mem/phase/rollout/descendants_gib/max")
        nvml.add_process(child.pid, 900 * MIB)  # "asleep", yet holding 900 MiB (NeMo-RL#223)
        out = run_until_split(monitor, nvml, phase="update", until="mem/phase/update/descendants_gib/max")
        monitor.close()
    finally:
        child.kill()
        child.wait(10)
    assert out["mem/phase/update/descendants_gib/max"] * 1024 == pytest.approx(900)
    assert "mem/phase/rollout/descendants_gib/max" not in out  # rollout did not run in this window


@in_host_namespace
def test_own_pid_missing_leaves_every_owner_unknown_but_the_unattributed_rest() -> None:
    cuda, nvml, monitor = fixture(own_pid=NOT_OURS)  # the driver lists us under a PID we cannot join
    nvml.add_process(NOT_OURS - 1, 200 * MIB)
    out = run_until_split(monitor, nvml)
    split_now = monitor._attribution.fresh(2.0) if monitor._attribution else None
    monitor.close()
    _assert_absent(out, ("nontorch", "siblings", "descendants", "foreign"))
    assert mib(out, "unattributed") == 0  # every byte is in some process: known, and 0
    assert split_now is not None and "not among NVML's processes" in split_now.reasons["nontorch"]


@in_host_namespace
def test_mig_refusing_per_process_queries_leaves_every_part_unknown() -> None:
    cuda, nvml, monitor = fixture(mig=True)
    out = run_until_split(monitor, nvml)
    attribution = monitor._attribution
    assert attribution is not None
    reasons = attribution.fresh(2.0).reasons  # type: ignore[union-attr]
    monitor.close()
    _assert_absent(out, KEYS)
    assert set(reasons) == set(KEYS)
    mig = "per-process figures unsupported under MIG (Insufficient Permissions"
    assert all(r.startswith(mig) for r in reasons.values())
    assert "mem/device/used_gib/max" in out  # torch's own figures stay


@in_host_namespace
def test_not_available_figures_are_absent_never_zero() -> None:
    cuda, nvml, monitor = fixture(own_not_available=True)
    child = _sleeper()
    try:
        nvml.add_process(child.pid, 500 * MIB)
        nvml.add_process(NOT_OURS, None)  # another process whose figure the driver does not know
        out = run_until_split(monitor, nvml)
        monitor.close()
    finally:
        child.kill()
        child.wait(10)
    _assert_absent(out, ("nontorch", "foreign", "unattributed"))
    assert mib(out, "descendants") == pytest.approx(500)  # known: the engine's own figure is there


@in_host_namespace
def test_the_training_thread_pays_no_nvml_call() -> None:
    cuda, nvml, monitor = fixture()
    run_until_split(monitor, nvml)
    with pytest.raises(FakeOutOfMemoryError):
        with monitor.step(99):
            cuda.malloc(64 * 2**30)  # an OOM event asks for a fresh split: the thread takes it
    monitor.close()
    assert nvml.calls and threading.get_ident() not in nvml.threads()
    assert [name for name, _ in nvml.calls][0] == "nvmlInit"


@in_host_namespace
def test_an_oom_event_carries_a_fresh_split_in_its_device_table(tmp_path: Path) -> None:
    cuda = FakeCuda(context=300 * MIB, total=4 * 2**30)
    nvml = FakeNvml(cuda)
    nvml.add_process(NOT_OURS, 1024 * MIB)
    monitor = Monitor(device_module=cuda, nvml_module=nvml, out_dir=str(tmp_path), sinks=(), nvml_refresh_s=3600,
                      leak_check=False, near_oom_watch=False)
    cuda.set_device(0)
    with monitor.step(0):
        cuda.malloc(1024 * MIB)
    monitor.collect()  # starts the thread; its first split is at once, the next in an hour
    deadline = time.monotonic() + 30
    while monitor._attribution is not None and monitor._attribution.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread's start (nvmlInit, the handle) is not what the event waits for
    with pytest.raises(FakeOutOfMemoryError):
        with monitor.step(1):
            cuda.malloc(2048 * MIB)  # 300 + 1024 + 1024 held: 2048 more does not fit in 4096
    monitor.close()
    event = json.loads((tmp_path / "events" / "rank0.jsonl").read_text().splitlines()[0])
    table = event["device"]["attribution"]
    assert table["step"] == 1 and table["foreign_bytes"] == 1024 * MIB
    assert table["reserved_bytes"] == 1024 * MIB and table["nontorch_bytes"] == 300 * MIB
    assert table["reasons"] == {}


def test_split_names_the_missing_figure_instead_of_a_zero() -> None:
    """vllm-omni#6249's regression at the unit: a process NVML lists without a figure never sums as 0."""
    result = split(10 * MIB, 2 * MIB, [(1, 5 * MIB), (2, None)], Owners(1, mapping="test"))
    assert result.nontorch == 3 * MIB
    assert result.unattributed is None and result.foreign is None
    assert "NVML_VALUE_NOT_AVAILABLE for pid 2" in result.reasons["unattributed"]
    unmapped = split(10 * MIB, 2 * MIB, [(7, 5 * MIB)], Owners(None, mapping="host PIDs not mapped"))
    assert (unmapped.nontorch, unmapped.descendants, unmapped.foreign, unmapped.unattributed) == (None, None, None,
                                                                                                  5 * MIB)
    for r in (result, unmapped):
        for part in KEYS:
            assert (getattr(r, part) is None) == (part in r.reasons)


def test_fake_nvml_errors_are_pynvmls() -> None:
    pynvml = pytest.importorskip("pynvml")
    for name in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_NOT_FOUND",
                 "NVML_ERROR_UNINITIALIZED"):
        assert getattr(FakeNvml, name) == getattr(pynvml, name)
    err = NVMLError(FakeNvml.NVML_ERROR_NOT_SUPPORTED)
    assert type(err).__name__ == "NVMLError_NotSupported" and err.value == 3 and str(err) == "Not Supported"
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) == str(err)
    nvml = FakeNvml(FakeCuda())
    with pytest.raises(NVMLError) as raised:
        nvml.nvmlDeviceGetCount()  # before nvmlInit, as the library answers
    assert raised.value.value == FakeNvml.NVML_ERROR_UNINITIALIZED
    assert FakeNvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value


def test_without_nvml_attribution_is_off_and_no_key_appears() -> None:
    cuda = FakeCuda()
    monitor = Monitor(device_module=cuda, sinks=(), leak_check=False)
    cuda.set_device(0)
    cuda.malloc(MIB)
    with monitor.step(0):
        pass
    out = monitor.collect()
    assert monitor.device_attribution.startswith("off")
    monitor.close()
    _assert_absent(out, KEYS)


def test_parse_nspid() -> None:
    assert parse_nspid(b"Name:\tpython\nNSpid:\t81234\t17\t1\nNSpgid:\t1\n") == [81234, 17, 1]
    assert parse_nspid(b"Name:\tpython\nPid:\t5\n") is None  # Linux < 4.1
    assert parse_nspid(b"NSpid:\tx\n") is None


@in_host_namespace
def test_pid_view_here_is_the_host_namespace() -> None:
    from rankmem.probe.pidmap import pid_view

    view = pid_view()
    assert view.method == HOST_NAMESPACE and view.host_pid == os.getpid() == view.proc_pid


def test_refresh_option_is_checked() -> None:
    for bad in (0, -1, math.inf, "10", True):
        with pytest.raises(RankmemError, match="nvml_refresh_s must be"):
            Monitor(device="cpu", sinks=(), nvml_refresh_s=bad)


@in_host_namespace
def test_a_near_oom_event_carries_the_split(tmp_path: Path) -> None:
    from rankmem.forensics.forensics import Forensics
    from rankmem.probe.device import DeviceBackend
    from rankmem.probe.host import make_host_probe
    from rankmem.probe.nvmlwatch import DeviceAttribution

    cuda = FakeCuda(context=300 * MIB)
    nvml = FakeNvml(cuda, managed=128 * MIB)
    device = DeviceBackend("cuda", cuda)
    attribution = DeviceAttribution(device, 3600, nvml_module=nvml)
    host = make_host_probe(children=False)
    forensics = Forensics(str(tmp_path), 0, host, device, near_oom_watch=False, attribution=attribution)
    cuda.set_device(0)
    cuda.malloc(512 * MIB)
    device.read()  # the training thread's read finds the device; the next poll starts the thread
    attribution.poll()
    forensics._near_oom(NearOomEvent(rank=0, step=5, phase=None, reasons=("node available low",)))
    forensics.close()
    attribution.close()
    host.close()
    event = json.loads((tmp_path / "events" / "rank0.jsonl").read_text())
    table = event["device"]["attribution"]
    assert table["unattributed_bytes"] == 128 * MIB and table["reserved_bytes"] == 512 * MIB
    assert table["nontorch_bytes"] == 300 * MIB and table["foreign_bytes"] == 0


# ---- the attribution thread is a failure boundary (rankmem.core.guard): one warning, training goes on ----

def _attribution() -> DeviceAttribution:
    cuda = FakeCuda(context=300 * MIB)
    device = DeviceBackend("cuda", cuda)
    cuda.set_device(0)
    cuda.malloc(512 * MIB)
    device.read()  # the training thread's read finds the device; the next poll starts the thread
    return DeviceAttribution(device, 0.01, nvml_module=FakeNvml(cuda))


def test_a_failing_sample_warns_once_and_the_thread_samples_on(monkeypatch: pytest.MonkeyPatch) -> None:
    attribution = _attribution()
    real = attribution._sample
    failures = [RuntimeError("process gone mid-read")] * 3

    def flaky(*args: object) -> None:
        if failures:
            raise failures.pop()
        real(*args)

    monkeypatch.setattr(attribution, "_sample", flaky)
    with pytest.warns(RuntimeWarning) as caught:
        attribution.poll()
        deadline = time.monotonic() + 10
        while attribution.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        attribution.close()
    assert attribution.poll() is not None and not failures  # three samples failed, then it split
    assert [str(w.message) for w in caught] == [
        "rankmem: a device attribution sample failed: RuntimeError('process gone mid-read')"]


def test_a_failure_that_stops_the_thread_warns_once_and_says_so_in_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    attribution = _attribution()

    def refuses(index: int) -> None:
        raise RankmemError("a user error in a thread has no caller to reach")

    monkeypatch.setattr(attribution, "_open", refuses)
    with pytest.warns(RuntimeWarning) as caught:
        attribution.poll()
        assert attribution._thread is not None
        attribution._thread.join(5)
    assert attribution.status == "stopped: RankmemError('a user error in a thread has no caller to reach')"
    assert attribution.fresh(0.1) is None  # the thread is gone: no wait
    assert [str(w.message) for w in caught] == [
        "rankmem: device attribution stopped: RankmemError('a user error in a thread has no caller to reach')"]


def test_an_nvml_error_whose_text_needs_the_library_gone_is_named_by_its_code() -> None:
    from rankmem.probe.nvml import error_text

    class LibraryGone(NVMLError):
        def __str__(self) -> str:
            raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED: what pynvml's nvmlErrorString raises after shutdown

    nvml = FakeNvml(FakeCuda())
    assert error_text(nvml, LibraryGone(999)) == "NVML error 999 (NVML_ERROR_UNKNOWN)"
