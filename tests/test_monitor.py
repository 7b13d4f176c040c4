"""The public surface: an honest __all__, no torch at import, clear errors for bad configuration."""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import rankmem
from rankmem.offline import read_run
from rankmem.sinks import SafeSink


class Broken:
    """A sink whose every write fails (a full disk); ``close_error`` makes its close fail too."""

    def __init__(self, close_error: Exception | None = None) -> None:
        self.writes = 0
        self.close_error = close_error

    def open(self, header: object) -> None:
        pass

    def write(self, record: object) -> None:
        self.writes += 1
        raise OSError("disk full")

    def close(self) -> None:
        if self.close_error is not None:
            raise self.close_error

def test_all_is_exactly_the_public_names() -> None:
    for name in rankmem.__all__:  # each loads its module at first use
        assert getattr(rankmem, name) is not None
    future = {"annotations"}  # `from __future__ import annotations` leaves this name behind
    for name in rankmem.__all__:  # names load on first use: each of them must
        getattr(rankmem, name)
    public = {n for n in vars(rankmem) if not n.startswith("_") or n == "__version__"} - future
    modules = {n for n in public if type(getattr(rankmem, n)).__name__ == "module"}
    assert set(rankmem.__all__) == public - modules


def test_import_does_not_import_torch() -> None:
    code = "import sys, rankmem; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sinks": ("jsonl",)}, "set out_dir='runs/NAME'"),
        ({"sinks": ("graphite",)}, "unknown sink 'graphite': choose from console, jsonl"),
        ({"log_rank": -1}, "log_rank must be a rank: a whole number >= 0, got -1"),
        ({"children_refresh_s": 0}, "children_refresh_s must be a finite number of seconds > 0, got 0"),
        ({"colour": "red"}, "unknown Monitor option(s) ['colour']"),
    ],
)
def test_bad_config_is_one_clear_error(options: dict[str, object], message: str) -> None:
    with pytest.raises(rankmem.RankmemError) as info:
        rankmem.Monitor(**options)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_bad_phase_name_is_a_clear_error() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu")
    with pytest.raises(rankmem.RankmemError, match="phase name must match"):
        with monitor.phase("roll out"):
            pass


def test_non_scalar_metric_is_dropped_with_one_warning() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    with pytest.warns(RuntimeWarning, match="metric 'texts' is not a scalar"):
        out = monitor.collect({"texts": ["a"], "loss": 2.0})
    assert out["loss/mean"] == 2.0 and "texts/mean" not in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        monitor.collect({"texts": ["a"], "loss": 2.0})


def test_failing_sink_warns_once_and_training_goes_on(tmp_path: object) -> None:
    broken = Broken()
    monitor = rankmem.Monitor(sinks=(broken,), device="cpu", children=False)
    with pytest.warns(RuntimeWarning, match="Broken failed in write.*disk full"):
        monitor.collect({"loss": 1.0})
        assert monitor.flush(30)  # the sinks write on the publisher's thread
    out = monitor.collect({"loss": 3.0})
    assert out["loss/max"] == 3.0
    assert monitor.flush(30)
    assert broken.writes == 1  # disabled after the first failure
    assert all(isinstance(s, SafeSink) for s in monitor._publisher._sinks)


def test_single_process_collect_needs_no_process_group() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    out = monitor.collect({"loss": 4.0}, step=7)
    assert out["loss/max_rank"] == 0 and out["loss/min"] == 4.0
    assert monitor.last_record is not None and monitor.last_record.step == 7
    assert monitor.last_record.ranks["loss"] == [4.0]
    assert monitor.fallbacks == 0  # no collective at all


def test_warnings_as_errors_cannot_make_telemetry_raise() -> None:
    monitor = rankmem.Monitor(sinks=(Broken(close_error=OSError("still full")),), device="cpu", children=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under `python -W error` or pytest's filterwarnings=error
        out = monitor.collect({"loss": 1.0, "texts": ["not a scalar"]})
        monitor.close()
    assert out["loss/max"] == 1.0 and "texts/max" not in out


def test_a_closed_monitor_says_so() -> None:
    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    monitor.close()
    with pytest.raises(rankmem.RankmemError, match="this Monitor is closed: build a new one"):
        monitor.collect()
    with pytest.raises(rankmem.RankmemError, match="this Monitor is closed"):
        with monitor.step(0):
            pass


def test_a_failing_probe_still_takes_part_in_collect() -> None:
    class VanishedProc:
        """A host probe (passed in through the public API) whose every read fails."""

        peak_scope = "window"

        def edge(self) -> tuple[int | None, int | None]:
            raise OSError("/proc vanished")

        def read(self, process: bool = True) -> rankmem.HostReading:
            raise OSError("/proc vanished")

        def close(self) -> None:
            pass

    with pytest.warns(RuntimeWarning, match="memory probe failed"):
        monitor = rankmem.Monitor(sinks=(), device="cpu", host_probe=VanishedProc())
        out = monitor.collect({"loss": 2.0})
    assert out["loss/max"] == 2.0  # the caller's metrics still travel; memory is absent, not 0
    assert not any(k.startswith("mem/host/rss") for k in out)


def test_a_bug_while_measuring_still_sends_the_callers_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankmem.monitor as monitor_module

    def broken(*args: object) -> None:
        raise KeyError("a telemetry bug")

    monitor = rankmem.Monitor(sinks=(), device="cpu", children=False)
    monkeypatch.setattr(monitor_module, "rank_metrics", broken)
    with pytest.warns(RuntimeWarning, match="measuring this rank failed, it sends only the caller's metrics"):
        out = monitor.collect({"loss": 3.0})
    assert out["loss/max"] == 3.0 and not any(k.startswith("mem/") for k in out)
    monkeypatch.undo()
    assert "mem/host/rss_gib/max" in monitor.collect({"loss": 3.0})  # the next step measures again


def test_sample_shows_gib_not_bytes() -> None:
    from rankmem.core.records import HostReading

    host = HostReading(rss=3 * 2**29, peak_rss=2**31, peak_rss_is_lifetime=True, children_rss=None,
                       node_total=2**35, node_available=2**34, cgroup_used=None, cgroup_limit=None)
    s = rankmem.MemorySample(host=host, device=None, device_name="none")
    assert repr(s) == str(s) == (
        "MemorySample(device='none', host/rss=1.500 GiB, host/peak_rss=2.000 GiB (lifetime), "
        "node/used=16.000 GiB, node/available=16.000 GiB)"
    )
    assert s.host.rss == 3 * 2**29  # the record keeps its bytes
    assert " GiB" in repr(rankmem.sample(device="cpu"))


def test_warnings_name_the_callers_line(tmp_path: object) -> None:
    monitor = rankmem.Monitor(sinks=(Broken(),), device="cpu", children=False, sink_thread=False)
    with pytest.warns(RuntimeWarning, match="Broken failed in write") as caught:
        line = sys._getframe().f_lineno + 1
        monitor.collect({"loss": 1.0})
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    # On rankmem's own sink thread no line is the caller's: one line naming rankmem instead.
    monitor = rankmem.Monitor(sinks=(Broken(),), device="cpu", children=False)
    with pytest.warns(RuntimeWarning, match="Broken failed in write") as caught:
        monitor.collect({"loss": 1.0})
        assert monitor.flush(30)
    assert (caught[0].filename, caught[0].lineno) == ("rankmem", 0)


def _monitor(out: Path, **options: Any) -> rankmem.Monitor:
    return rankmem.Monitor(out_dir=str(out), device="cpu", near_oom_watch=False, **options)


# ---- Monitor.set_step names a step the run log does not ----------------------------------------

def test_set_step_is_the_step_collect_logs(tmp_path: Path) -> None:
    """set_step(n) makes heartbeats and OOM events say step n, but collect() without step= logs the
    collect counter: events and the run log then disagree on which step a window was (step() windows
    do not have this problem: they set step_n)."""
    m = _monitor(tmp_path)
    for n in (10, 11):
        m.set_step(n)
        m.collect({"loss": 1.0})
    m.close()
    assert read_run(str(tmp_path)).steps.tolist() == [10, 11]



def test_children_refresh_inf_is_refused_or_works(monkeypatch):
    """MonitorConfig accepts children_refresh_s=inf (only `> 0` is checked, _monitor.py __post_init__);
    the children-USS thread then dies on its first Event.wait(inf) with OverflowError ('timestamp out
    of range'), an uncaught exception in a rankmem thread (_children.py _run: the wait is outside the
    try). Either refuse it with a RankmemError, or treat it as 'never refresh' without a crash."""
    import time

    import rankmem
    from rankmem.errors import RankmemError

    crashes = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    try:
        monitor = rankmem.Monitor(device="cpu", near_oom_watch=False, leak_check=False,
                                  children_refresh_s=float("inf"))
    except RankmemError:
        return  # refused up front: fine
    try:
        monitor.collect()
        time.sleep(0.3)
    finally:
        monitor.close()
    assert crashes == []  # fails: [OverflowError('timestamp out of range for platform time_t')]



@pytest.mark.parametrize("options", [
    {"log_rank": "0"},  # a value read from YAML / an environment variable / a CLI string
    {"children_refresh_s": "5"},
    {"children_refresh_s": None},
    {"sinks": 5},
    {"out_dir": 123},
])
def test_monitor_config_wrong_type_is_one_rankmem_error(options):
    """MonitorConfig.__post_init__ (_monitor.py) compares before checking types: a string log_rank or
    children_refresh_s raises a bare TypeError ('<' not supported between 'str' and 'int'), a non-path
    out_dir a TypeError from os.path.join inside Monitor, instead of one RankmemError naming the option."""
    import rankmem
    from rankmem.errors import RankmemError

    with pytest.raises(RankmemError):
        rankmem.Monitor(device="cpu", near_oom_watch=False, **options).close()


def test_numpy_numbers_are_options_too(tmp_path: Path) -> None:
    import json

    import numpy as np

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", near_oom_watch=False, log_rank=np.int64(0),
                              children_refresh_s=np.float32(2.5))
    monitor.collect()
    monitor.close()
    header = json.loads((tmp_path / "rankmem.jsonl").read_text().splitlines()[0])
    assert header["config"]["log_rank"] == 0 and header["config"]["children_refresh_s"] == 2.5
