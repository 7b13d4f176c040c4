"""The run log reader: arrays per key, corrupt and truncated lines counted, clear errors for bad files."""

from __future__ import annotations

import math
import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.core.records import RunHeader, StepRecord
from rankmem.errors import RankmemError
from rankmem.offline import read_run
from rankmem.runlog import RUN_LOG_NAME, RunLogWriter
from rankmem.runlog import layout as L
from rankmem.runlog.layout import DETAIL_NAME
from tests.runlog_helpers import write_run

RSS = "mem/host/rss_gib"


def _two_rank(tmp_path: Path, n: int = 6) -> Path:
    rss = np.column_stack([np.arange(n) * 0.5, np.arange(n) * 0.25 + 1.0])
    phase = np.full((n, 2), np.nan)
    phase[::2, 1] = 7.0  # only rank 1, only on even steps
    return write_run(tmp_path, {RSS: rss, "mem/phase/update/peak_rss_gib": phase}, steps=np.arange(n) * 10)


def test_reads_values_steps_and_missing_as_nan(tmp_path: Path) -> None:
    _two_rank(tmp_path)
    run = read_run(str(tmp_path))  # a run directory works as well as the file
    assert run.world_size == 2
    assert run.steps.tolist() == [0, 10, 20, 30, 40, 50]
    assert run.series[RSS][:, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert run.series[RSS][:, 1].tolist() == [1.0, 1.25, 1.5, 1.75, 2.0, 2.25]
    phase = run.series["mem/phase/update/peak_rss_gib"]
    assert np.isnan(phase[:, 0]).all()
    assert phase[::2, 1].tolist() == [7.0, 7.0, 7.0]
    assert np.isnan(phase[1::2, 1]).all()
    assert run.phases() == ["update"]
    assert run.corrupt == 0 and not run.truncated and run.metrics is None and run.slow_lines == 0
    assert run.logged is None and run.detail_note is None and run.gaps == []


def test_metrics_option_reads_the_lines_aggregates(tmp_path: Path) -> None:
    path = _two_rank(tmp_path)
    full = read_run(str(path), metrics=True)
    fast = read_run(str(path))
    assert full.metrics is not None
    assert full.metrics[RSS + "/max"].tolist() == [1.0, 1.25, 1.5, 1.75, 2.0, 2.5]
    assert full.metrics[RSS + "/max_rank"].tolist() == [1, 1, 1, 1, 0, 0]  # the tie at step 40 goes to rank 0
    np.testing.assert_array_equal(full.series[RSS], fast.series[RSS])


def _side(tmp_path: Path) -> Path:
    return tmp_path / DETAIL_NAME


def test_a_record_cut_short_is_skipped_and_flagged_and_its_line_still_read(tmp_path: Path) -> None:
    _two_rank(tmp_path)
    data = _side(tmp_path).read_bytes()
    _side(tmp_path).write_bytes(data[:-20])  # a crash in the last record's write
    run = read_run(str(tmp_path))
    assert run.truncated and run.steps.tolist() == [0, 10, 20, 30, 40]
    assert run.logged is not None and run.logged.steps.tolist() == [0, 10, 20, 30, 40, 50]
    assert run.logged.metrics[RSS + "/max"][-1] == 2.5


def test_a_damaged_record_ends_the_per_rank_values_there_and_says_so(tmp_path: Path) -> None:
    _two_rank(tmp_path)
    data = bytearray(_side(tmp_path).read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit, mid-file
    _side(tmp_path).write_bytes(bytes(data))
    run = read_run(str(tmp_path))
    assert run.detail_note is not None and "checksum does not match" in run.detail_note
    assert 0 < run.steps.size < 6 and run.series[RSS][:, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0][: run.steps.size]
    assert run.logged is not None and run.logged.steps.tolist() == [0, 10, 20, 30, 40, 50]


def _collect_block_at(data: bytes, step: int) -> int:
    """Where the per-rank block of ``step``'s collect record starts in a side file's bytes."""
    off = L.FILE_HEADER.size
    while True:
        kind, n = L.RECORD_HEAD.unpack_from(data, off)
        if kind == L.COLLECT and L.COLLECT_HEAD.unpack_from(data, off + 16)[0] == step:
            return off + 16 + L.COLLECT_HEAD.size
        off += 16 + 8 * n + 8


def _record_end(data: bytes, block: int) -> int:
    """Where the checksum word of the collect record whose per-rank block starts at ``block`` is."""
    head = block - L.COLLECT_HEAD.size - 16
    return head + 16 + 8 * L.RECORD_HEAD.unpack_from(data, head)[1]


DAMAGE = ["two ranks' values swapped", "a value zeroed", "two values' signs flipped", "a value's sign and the "
          "checksum's top bit flipped", "the step's sign and the checksum's top bit flipped"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_a_weighted_sum_of_the_words_would_miss_is_named(tmp_path: Path, damage: str) -> None:
    """Step 20 holds rank 0's 1.0 and rank 1's 1.5 for the same key: swapping them keeps the words' sum;
    a top bit flipped twice keeps any sum of the words times odd weights (2**63 + 2**63 is 0 modulo 2**64)."""
    _two_rank(tmp_path)
    data = bytearray(_side(tmp_path).read_bytes())
    at = _collect_block_at(bytes(data), 20)
    first, other = data[at : at + 8], data[at + 16 : at + 24]  # rank 0's and rank 1's RSS (2 keys a rank)
    assert struct.unpack("<d", first)[0] == 1.0 and struct.unpack("<d", other)[0] == 1.5
    checksum, step = _record_end(bytes(data), at), at - L.COLLECT_HEAD.size  # where their words start
    flipped = {DAMAGE[2]: [at + 7, at + 23], DAMAGE[3]: [at + 7, checksum + 7], DAMAGE[4]: [step + 7, checksum + 7]}
    for byte in flipped.get(damage, []):  # the top bit of a little-endian word: its 8th byte's 0x80
        data[byte] ^= 0x80
    if damage == "a value zeroed":
        data[at : at + 8] = bytes(8)
    elif damage.endswith("swapped"):
        data[at : at + 8], data[at + 16 : at + 24] = other, first
    _side(tmp_path).write_bytes(bytes(data))
    run = read_run(str(tmp_path))
    assert run.detail_note is not None and "checksum does not match" in run.detail_note
    assert run.steps.tolist() == [0, 10] and run.series[RSS][:, 0].tolist() == [0.0, 0.5]  # nothing misread
    assert run.series[RSS][:, 1].tolist() == [1.0, 1.25]
    assert run.logged is not None and run.logged.steps.tolist() == [0, 10, 20, 30, 40, 50]


def test_a_damaged_record_length_that_runs_past_the_end_is_named_not_taken_for_a_cut(tmp_path: Path) -> None:
    """A length word damaged mid-file can send a record past the file's end, as a crash cuts the last one:
    but a record goes before its line, and the log's lines go on past this one."""
    _two_rank(tmp_path)
    data = bytearray(_side(tmp_path).read_bytes())
    head = _collect_block_at(bytes(data), 20) - L.COLLECT_HEAD.size - 16
    data[head + 8 : head + 16] = (1 << 20).to_bytes(8, "little")  # under MAX_WORDS, past the end
    _side(tmp_path).write_bytes(bytes(data))
    run = read_run(str(tmp_path))
    assert run.detail_note is not None and f"the record at byte {head} runs past the file's end" in run.detail_note
    assert run.steps.tolist() == [0, 10] and run.series[RSS][:, 1].tolist() == [1.0, 1.25]
    assert run.logged is not None and run.logged.steps.tolist() == [0, 10, 20, 30, 40, 50]


def test_a_length_damaged_to_a_huge_record_is_checked_in_small_slices(tmp_path: Path) -> None:
    """A length word damaged to 2**24 words in a file that long (sparse): the check reads it in slices,
    allocating a few MiB, not the 128 MiB record three times over."""
    _two_rank(tmp_path)
    words = 1 << 24
    with open(_side(tmp_path), "ab") as f:
        f.write(L.RECORD_HEAD.pack(L.COLLECT, words))
        end = f.tell() + 8 * words + 8
    os.truncate(_side(tmp_path), end)
    tracemalloc.start()
    try:
        run = read_run(str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.detail_note is not None and "its checksum does not match" in run.detail_note
    assert run.steps.tolist() == [0, 10, 20, 30, 40, 50] and peak < 32 << 20, peak


def test_a_missing_side_file_is_noted_and_the_aggregates_read(tmp_path: Path) -> None:
    _two_rank(tmp_path)
    _side(tmp_path).unlink()
    run = read_run(str(tmp_path))
    assert run.detail_note is not None and "is missing" in run.detail_note and run.steps.size == 0
    assert run.logged is not None and run.logged.metrics[RSS + "/min"].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.25]


def test_lines_past_the_side_file_and_corrupt_ones_are_counted(tmp_path: Path) -> None:
    path = _two_rank(tmp_path)
    with open(path, "a") as f:
        f.write("this is not json\n")
        f.write('{"kind":"step","step":60,"time":1.0,"metrics":{"x/max":1.0}}\n')
        f.write('{"kind":"step","step":70,"ti')  # a crash mid-write: no newline
    run = read_run(str(path))
    assert run.corrupt_lines == [8] and run.truncated
    assert run.steps.tolist() == [0, 10, 20, 30, 40, 50]
    assert run.logged is not None and run.logged.steps.tolist() == [0, 10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty: the run wrote no header"),
        ('{"kind":"step","step":0}\n', "has no header line"),
        ("garbage\n", "has no header line"),
        ('{"kind":"header","schema":7,"world_size":1}\n', "has run log schema 7; this rankmem reads schema 3"),
    ],
)
def test_bad_files_raise_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / RUN_LOG_NAME
    path.write_text(content)
    with pytest.raises(RankmemError, match=message):
        read_run(str(path))


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(RankmemError, match=f"no run log in {tmp_path}: expected .*{RUN_LOG_NAME}"):
        read_run(str(tmp_path))
    with pytest.raises(RankmemError, match="no run log at .*nope.jsonl: pass a run directory"):
        read_run(str(tmp_path / "nope.jsonl"))


def test_real_monitor_run_reads_back(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), sinks=("jsonl",), device="cpu", children=False)
    for step in range(4):
        with monitor.step(step):
            with monitor.phase("update"):
                pass
        monitor.collect({"loss": 1.0 / (step + 1)})
    monitor.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == [0, 1, 2, 3]
    assert run.world_size == 1 and run.header.schema == 3 and run.header.detail == DETAIL_NAME
    assert run.series["loss"][:, 0].tolist() == [1.0, 0.5, 1.0 / 3, 0.25]
    assert (run.series[RSS] > 0.001).all()
    assert run.phases() == ["update"]


def test_keys_that_differ_by_collect_and_collects_without_values(tmp_path: Path) -> None:
    header = RunHeader(world_size=2, ranks=[], config={}, started=1.0, run_id="0123456789abcdef")
    writer = RunLogWriter(str(tmp_path / RUN_LOG_NAME))
    writer.open(header)
    rows = [(("a", "b"), [[1.0, 3.0], [2.0, math.nan]]), (("a",), [[4.0], [5.0]]), (("a", "b"), [[8.0, 6.0], [9.0,
                                                                                                              7.0]]),
            (("a", "b"), None), (("c",), [[16.0], [17.0]])]
    for step, (keys, matrix) in enumerate(rows):
        metrics = {f"{k}/max": 1.0 for k in keys}
        writer.write(StepRecord(step, 1.0 + step, metrics, keys=keys,
                                matrix=None if matrix is None else np.array(matrix)))
    writer.close()
    run = read_run(str(tmp_path))
    nan = math.nan
    np.testing.assert_array_equal(run.series["a"], [[1, 2], [4, 5], [8, 9], [nan, nan]])
    np.testing.assert_array_equal(run.series["b"], [[3, nan], [nan, nan], [6, 7], [nan, nan]])
    np.testing.assert_array_equal(run.series["c"], [[nan, nan]] * 3 + [[16, 17]])
    assert run.steps.tolist() == [0, 1, 2, 4] and run.corrupt == 0
    assert run.logged is not None and run.logged.steps.tolist() == [0, 1, 2, 3, 4]  # step 3: aggregates only


def test_the_record_checksum_catches_every_two_bit_error_of_a_record(tmp_path: Path) -> None:
    """Every pair of bits of a real collect record (its head, values and checksum word: 12 words), each
    pair flipped: the checksum of the damaged words never equals the damaged checksum word."""
    _two_rank(tmp_path)
    data = _side(tmp_path).read_bytes()
    block = _collect_block_at(data, 20)
    start, end = block - L.COLLECT_HEAD.size - 16, _record_end(data, block)
    record = np.frombuffer(data[start : end + 8], dtype="<u8")
    bits = record.size * 64
    first, second = np.triu_indices(bits, 1)
    for lo in range(0, first.size, 200_000):
        damaged = np.repeat(record[None, :], min(200_000, first.size - lo), axis=0)
        rows = np.arange(damaged.shape[0])
        for flip in (first[lo : lo + 200_000], second[lo : lo + 200_000]):
            damaged[rows, flip // 64] ^= np.uint64(1) << (flip % 64).astype(np.uint64)
        assert not (L.checksums(damaged[:, :-1]) == damaged[:, -1]).any()
