"""The run log's columnar side file: batches, crashes, a killed writer, a missing or foreign side file, no
pyarrow, old logs, and aggregates-only steps past the crossover."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import main
from rankmem.offline import read_run
from rankmem.offline.report import build_report
from rankmem.runlog import RUN_LOG_NAME
from rankmem.runlog import columnar as _columnar
from rankmem.runlog.checksum import CHECKSUM_KEY, PLACEHOLDER, seal
from rankmem.runlog.layout import DETAIL_NAME
from tests.conftest import REPO
from tests.runlog_helpers import write_run

RSS = "mem/host/rss_gib"
PEAK = "mem/host/peak_rss_gib"
STEPS, WORLD = 20, 3


def _truth() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    rss = rng.uniform(1.0, 2.0, (STEPS, WORLD))
    peak = rss + rng.uniform(0.0, 0.5, (STEPS, WORLD))
    peak[4, 2] = np.nan  # a rank without the key on one step
    return {RSS: rss, PEAK: peak}


def _batched_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int = 4) -> tuple[Path, dict[str, np.ndarray]]:
    monkeypatch.setattr(_columnar, "MAX_BATCH", per_batch)
    truth = _truth()
    return write_run(tmp_path, truth), truth


def _batch_ends(side: Path) -> list[int]:
    """Byte offsets where the schema and each batch end, read with pyarrow's own message reader."""
    return _batch_ends_of(side.read_bytes())


def test_batches_hold_every_collect_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, truth = _batched_run(tmp_path, monkeypatch)
    import pyarrow as pa

    with pa.memory_map(str(path.parent / DETAIL_NAME)) as source:
        table = pa.ipc.open_stream(source).read_all()
    assert table.num_rows == STEPS * len(truth)
    assert sorted(set(table.column("collect").to_pylist())) == list(range(STEPS))
    assert len(_batch_ends(path.parent / DETAIL_NAME)) == 1 + STEPS // 4  # the schema, then 5 batches


@pytest.mark.parametrize("cut", ["in the schema", "in batch 1", "after batch 2", "in batch 3", "in the end marker"])
def test_a_crash_mid_batch_reads_every_whole_batch_and_the_rest_from_the_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str) -> None:
    path, truth = _batched_run(tmp_path, monkeypatch)
    side = path.parent / DETAIL_NAME
    ends = _batch_ends(side)  # [schema, batch 1..5], then the 8-byte end-of-stream marker
    assert side.stat().st_size == ends[-1] + 8
    at = {"in the schema": ends[0] // 2, "in batch 1": (ends[0] + ends[1]) // 2, "after batch 2": ends[2],
          "in batch 3": ends[3] - 7, "in the end marker": ends[-1] + 5}[cut]
    whole = {"in the schema": 0, "in batch 1": 0, "after batch 2": 2, "in batch 3": 2, "in the end marker": 5}[cut]
    with open(side, "r+b") as f:
        f.truncate(at)
    run = read_run(str(tmp_path))
    n = whole * 4
    assert run.steps.tolist() == list(range(n))
    for key, matrix in truth.items():
        if n:
            np.testing.assert_array_equal(run.series[key], matrix[:n], err_msg=key)  # nothing misfiled
    # Every step is still there, its aggregates from the lines after the last whole batch.
    logged = run.logged if n < STEPS else None
    if n < STEPS:
        assert logged is not None and logged.steps.tolist() == list(range(STEPS))
        np.testing.assert_allclose(logged.metrics[RSS + "/max"], truth[RSS].max(axis=1))
        assert logged.metrics[RSS + "/max_rank"].tolist() == truth[RSS].argmax(axis=1).tolist()
        assert run.slow_lines == STEPS - n
    assert run.corrupt == 0
    # A cut inside a batch is flagged; a file cut inside its schema is no side file at all (said so).
    assert run.truncated == (cut in ("in batch 1", "in batch 3", "in the end marker"))
    assert (run.detail_note is not None) == (cut == "in the schema")


def test_a_killed_writer_loses_per_rank_values_of_its_last_second_only(tmp_path: Path) -> None:
    """A real Monitor SIGKILLed mid-run: every collect whose line was written is read back; the side
    file holds all but the last batch still waiting (at most a second's worth)."""
    script = textwrap.dedent(f"""
        import sys, time
        import rankmem
        monitor = rankmem.Monitor(out_dir={str(tmp_path)!r}, device="cpu", children=False, near_oom_watch=False)
        for step in range(10**6):
            with monitor.step(step):
                buf = bytearray(step % 7 * 2**20)
            monitor.collect({{"step_echo": float(step)}})
            monitor.flush()  # the line is on disk before the next step (the side file may still wait)
            print(step, flush=True)
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 60
        seen = -1
        while seen < 40 and time.monotonic() < deadline:
            seen = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert seen >= 40
    lines = (tmp_path / RUN_LOG_NAME).read_text().splitlines()[1:]
    written = [json.loads(line)["step"] for line in lines]
    run = read_run(str(tmp_path))
    every = run.logged.steps.tolist() if run.logged is not None else run.steps.tolist()
    assert every == written and len(written) >= 41
    # The side file's rows are a prefix of the steps, and hold what the lines' aggregates say.
    n = run.steps.size
    assert run.steps.tolist() == written[:n] and n >= len(written) - 30  # 30 collects: 1.5 s at 0.05 s each
    np.testing.assert_array_equal(run.series["step_echo"][:, 0], np.arange(n, dtype=float))
    for row, line in enumerate(lines[:n]):
        metrics = json.loads(line)["metrics"]
        assert run.series[RSS][row, 0] == metrics[RSS + "/max"]
    assert main(["report", str(tmp_path)]) == 0


def test_a_missing_side_file_reports_from_the_aggregates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = _truth()
    truth[RSS][13, 1] = 9.5  # the run's worst, on rank 1 at step 13
    write_run(tmp_path, truth)
    (tmp_path / DETAIL_NAME).unlink()
    run = read_run(str(tmp_path))
    assert run.steps.size == 0 and run.series == {} and "is missing" in str(run.detail_note)
    assert run.logged is not None and run.logged.steps.tolist() == list(range(STEPS))
    report = build_report(run)
    worst = next(k for k in report.keys if k.key == RSS)
    assert (worst.value, worst.step, worst.rank) == (9.5, 13, 1)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per-rank values on 0 of the 20 steps" in out and f"{tmp_path / DETAIL_NAME} is missing" in out


def test_a_side_file_of_another_run_is_not_read(tmp_path: Path) -> None:
    write_run(tmp_path / "a", _truth())
    write_run(tmp_path / "b", {RSS: np.ones((STEPS, WORLD + 1))})
    shutil.copy(tmp_path / "b" / DETAIL_NAME, tmp_path / "a" / DETAIL_NAME)
    run = read_run(str(tmp_path / "a"))
    assert run.series == {} and "written for a world of 4, the log's is 3" in str(run.detail_note)
    assert run.logged is not None and run.logged.steps.size == STEPS


def test_without_pyarrow_the_log_keeps_per_rank_values_on_its_lines(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.modules["pyarrow"] = None  # as if it were not installed
        import rankmem
        monitor = rankmem.Monitor(out_dir={str(tmp_path)!r}, device="cpu", children=False, near_oom_watch=False)
        for step in range(3):
            monitor.collect({{"tokens": 10.0 * step}}, step=step)
        monitor.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("pip install pyarrow") == 1
    assert not (tmp_path / DETAIL_NAME).exists()
    lines = [json.loads(line) for line in (tmp_path / RUN_LOG_NAME).read_text().splitlines()]
    assert lines[0]["detail"] == "inline" and [line["ranks"]["tokens"] for line in lines[1:]] == [[0.0], [10.0], [20.0]]
    run = read_run(str(tmp_path))
    assert run.series["tokens"].tolist() == [[0.0], [10.0], [20.0]] and run.logged is None


def test_a_log_written_by_the_previous_version_reads_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tests/data/schema1_run: a 6-step 2-rank GRPO run written by rankmem before the side file (schema 1,
    per-rank vectors on the lines), kept as it was written."""
    src = REPO / "tests" / "data" / "schema1_run"
    shutil.copytree(src, tmp_path / "run")
    lines = [json.loads(line) for line in (src / RUN_LOG_NAME).read_text().splitlines()]
    assert lines[0]["schema"] == 1 and "detail" not in lines[0]
    run = read_run(str(tmp_path / "run"))
    assert run.steps.tolist() == [line["step"] for line in lines[1:]] and run.logged is None
    for row, line in enumerate(lines[1:]):
        for key, vec in line["ranks"].items():
            want = [math.nan if v is None else float(v) for v in vec]
            np.testing.assert_array_equal(run.series[key][row], want, err_msg=key)
    for command in (["report"], ["leaks"], ["plot", "-o", str(tmp_path / "p.png")]):
        assert main([command[0], str(tmp_path / "run"), *command[1:]]) in (0, 3)  # leaks: 3 = too short to judge
    assert "2 ranks on 1 host, 6 logged steps" in capsys.readouterr().out


def test_past_the_crossover_the_worst_value_comes_from_every_steps_aggregates(tmp_path: Path) -> None:
    """Per-rank values every 10th collect; a spike on rank 77 at step 33 (no per-rank values there) is
    still the report's worst, from the aggregates, while the imbalance comes from the rows that have them."""
    from rankmem.core.records import RankInfo, RunHeader, StepRecord
    from rankmem.exchange.aggregate import aggregate
    from rankmem.runlog import RunLogWriter

    world, steps = 256, 60
    rng = np.random.default_rng(5)
    values = rng.uniform(1.0, 2.0, (steps, world))
    values[33, 77] = 7.25
    writer = RunLogWriter(str(tmp_path / RUN_LOG_NAME))
    writer.open(RunHeader(world_size=world, ranks=[RankInfo(r, r % 8, f"n{r // 8}", r, "none", "window")
                                                   for r in range(world)]))
    for step in range(steps):
        matrix = values[step][:, None]
        writer.write(StepRecord(step, 1.7e9 + step, aggregate([RSS], matrix), keys=[RSS],
                                matrix=matrix if step % 10 == 0 else None))
    writer.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == list(range(0, steps, 10))
    np.testing.assert_array_equal(run.series[RSS], values[::10])
    assert run.logged is not None and run.logged.steps.size == steps
    report = build_report(run)
    worst = next(k for k in report.keys if k.key == RSS)
    assert (worst.value, worst.step, worst.rank) == (7.25, 33, 77)
    per_rank_peak = values[::10].max(axis=0)
    assert worst.imbalance == pytest.approx(per_rank_peak.max() / per_rank_peak.mean())
    assert report.steps == steps and report.detail_steps == steps // 10
    # The plot draws every step's max from the aggregates over the per-rank lines, naming only the worst.
    from rankmem.offline.plot import draw_run

    fig = draw_run(run, [RSS])
    try:
        ax = fig.axes[0]
        (every,) = [ln for ln in ax.get_lines() if ln.get_label() == "max over ranks, every step"]
        np.testing.assert_array_equal(every.get_xdata(), np.arange(steps))
        np.testing.assert_array_equal(every.get_ydata(), values.max(axis=1))
        named = [t.get_text() for t in ax.get_legend().get_texts() if t.get_text().startswith("rank ")]
        assert len(named) == 1 and named[0].endswith("(worst)")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    # The side file stays small: a collect without per-rank values costs no per-rank bytes.
    assert (tmp_path / DETAIL_NAME).stat().st_size < (steps // 10 + 1) * world * 8 + steps * 400


def test_monitor_flush_puts_the_waiting_batch_on_disk(tmp_path: Path) -> None:
    """Collects quicker than a batch's second wait in memory; ``flush()`` (which a near-OOM event calls)
    writes them, so a reader sees every step's per-rank values before the job goes on or dies."""
    import rankmem

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, near_oom_watch=False)
    for step in range(3):
        monitor.collect({"tokens": 10.0 * step}, step=step)
    assert monitor.flush(30)
    run = read_run(str(tmp_path))
    assert run.logged is None and run.steps.tolist() == [0, 1, 2]
    assert run.series["tokens"].tolist() == [[0.0], [10.0], [20.0]]
    monitor.close()


def test_a_batch_with_lists_of_another_length_ends_the_read_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose per-rank lists are not world_size long (a damaged or foreign batch appended to a
    good file) is never cut or padded: reading stops before it, says why, and the lines give the rest."""
    import pyarrow as pa

    path, truth = _batched_run(tmp_path, monkeypatch)
    side = path.parent / DETAIL_NAME
    whole = _batch_ends(side)[2]  # the schema and two batches (8 collects)
    with open(side, "r+b") as f:
        f.truncate(whole)
    bad = pa.record_batch([pa.array([8]), pa.array([8]), pa.array([1.7e9]), pa.array([RSS]),
                           *[pa.array([1.0]) for _ in range(3)], pa.array([0], pa.int32()), pa.array([0], pa.int32()),
                           *[pa.array([1.0]) for _ in range(3)], pa.array([[1.0, 2.0]], pa.list_(pa.float64()))],
                          schema=_columnar.detail_schema(WORLD))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, bad.schema) as writer:
        writer.write_batch(bad, custom_metadata={CHECKSUM_KEY: PLACEHOLDER})
    stream = sink.getvalue().to_pybytes()
    ends = _batch_ends_of(stream)
    message = bytearray(stream[ends[0] : ends[1]])  # the bad batch, without its stream's own schema
    seal(message, 0, len(message))  # sealed as the writer seals: its checksum holds, its lengths do not
    with open(side, "ab") as f:
        f.write(bytes(message))
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == list(range(8)) and "not 3 long" in str(run.detail_note)
    np.testing.assert_array_equal(run.series[RSS], truth[RSS][:8])
    assert run.logged is not None and run.logged.steps.tolist() == list(range(STEPS))


def _batch_ends_of(data: bytes) -> list[int]:
    """Where each whole IPC message of ``data`` ends."""
    import pyarrow as pa

    source, ends = pa.BufferReader(data), []
    while True:
        try:
            pa.ipc.read_message(source)
        except (pa.ArrowInvalid, OSError, EOFError, StopIteration):
            return ends
        ends.append(source.tell())


def test_a_header_whose_detail_is_not_a_name_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, _truth())
    header, *lines = path.read_text().splitlines(keepends=True)
    damaged = json.loads(header)
    damaged["detail"] = 5
    path.write_text(json.dumps(damaged) + "\n" + "".join(lines))
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"rankmem report: error: {path}: the header's detail must name the per-rank "
                                       'file (or be "inline"), got 5; the header is damaged\n')


def test_a_disk_refusing_the_side_file_bounds_what_waits_and_loses_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the side file's writes fail (ENOSPC), the waiting per-rank values are bounded in bytes, the
    oldest shed first; once it writes again every step is there, the newest with their per-rank values."""
    import errno

    real = _columnar.append_whole
    refusing = False

    def append_whole(fd: int, data: bytes, size: int, path: str) -> int:
        if refusing:  # the disk is full from the first batch on (the schema went in at open)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(fd, data, size, path)

    monkeypatch.setattr(_columnar, "append_whole", append_whole)
    monkeypatch.setattr(_columnar, "MAX_BATCH", 1)  # try a batch at every collect
    monkeypatch.setattr(_columnar, "MAX_PENDING_BYTES", 3 * WORLD * 2 * 8)  # three collects' values
    truth = _truth()
    with pytest.warns(RuntimeWarning) as caught:
        from rankmem.core.records import RankInfo, RunHeader, StepRecord
        from rankmem.exchange.aggregate import aggregate
        from rankmem.runlog import RunLogWriter

        writer = RunLogWriter(str(tmp_path / RUN_LOG_NAME))
        writer.open(RunHeader(world_size=WORLD, ranks=[RankInfo(r, r, "n", r, "none", "window") for r in range(WORLD)]))
        refusing = True
        keys = sorted(truth)
        for step in range(10):
            matrix = np.column_stack([truth[k][step] for k in keys])
            writer.write(StepRecord(step, 1.7e9 + step, aggregate(keys, matrix, nan_is_absent=True), keys=keys,
                                    matrix=matrix))
        detail = writer._detail
        assert detail is not None and detail.dropped == 7
        refusing = False
        writer.close()
    assert any("cannot be written" in str(w.message) for w in caught)
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == [7, 8, 9]  # the newest three kept their per-rank values
    np.testing.assert_array_equal(run.series[RSS], truth[RSS][7:10])
    assert run.logged is not None and run.logged.steps.tolist() == list(range(10))
    np.testing.assert_allclose(run.logged.metrics[RSS + "/max"], truth[RSS][:10].max(axis=1))


# ---- A batch pyarrow refuses costs its collects' aggregates and steps too --------------------------

def test_a_batch_arrow_cannot_encode_keeps_its_collects_aggregates(tmp_path: Path) -> None:
    """DetailWriter.flush's `except Exception` drops the pending collects ("keep only their aggregates"),
    but the next batch's LOG_OFFSET lies past their JSON lines, and the reader only reads lines after the
    last batch's offset: those collects vanish from read_run altogether, and Run.logged is None (the
    reader believes every collect is there). Trigger here: a caller's metric key holding a lone surrogate
    (a name decoded with surrogateescape), which json.dumps writes but Arrow refuses."""
    import rankmem

    m = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", near_oom_watch=False)
    m.collect({"loss": 0.0}, step=0)
    m.collect({"loss": 1.0, "io/\udcffname": 1.0}, step=1)
    m.flush()
    m.collect({"loss": 2.0}, step=2)
    m.close()
    lines = (tmp_path / "rankmem.jsonl").read_text(errors="replace").splitlines()
    assert len(lines) == 4  # header + 3 steps: every line was written
    run = read_run(str(tmp_path))
    every = run.logged.steps.tolist() if run.logged is not None else run.steps.tolist()
    assert every == [0, 1, 2], f"read_run sees steps {every} of the 3 logged"
