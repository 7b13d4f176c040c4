"""CLI faults (issue 11, item 13): options that would be silently accepted are refused in one line
(exit 2), an unwritable plot is one line, and a gzip'd run log is read as it is."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rankmem.cli import main
from rankmem.offline import read_run
from rankmem.runlog import RUN_LOG_NAME
from rankmem.runlog.layout import DETAIL_NAME
from tests.conftest import REPO
from tests.runlog_helpers import known_run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["leaks", "{run}", "--min-growth", "nan"], "--min-growth must be a finite number, got nan"),
        (["leaks", "{run}", "--alpha", "nan"], "--alpha must be a finite number, got nan"),
        (["report", "{run}", "--window", "nan"], "--window must be a finite number, got nan"),
        (["leaks", "{run}", "--keys", "mem/host/rss_gib", "nope"],
         "--keys: no such key(s) in the run log: nope; it has: mem/device/headroom_gib, mem/host/peak_rss_gib, "
         "mem/host/rss_gib, mem/phase/rollout/peak_rss_gib, mem/phase/update/peak_rss_gib"),
        (["plot", "{run}", "-o", "/dev/full"], "-o /dev/full: is a character device; rankmem replaces only a "
                                              "regular file: name a file"),
    ],
)
def test_bad_options_and_outputs_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         args: list[str], message: str) -> None:
    known_run(tmp_path)
    args = [a.replace("{run}", str(tmp_path)) for a in args]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err == f"rankmem {args[0]}: error: {message}\n"
    assert captured.out == ""


def test_a_gzipped_run_log_is_read_directly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = known_run(tmp_path / "plain")
    gz = tmp_path / "gz" / (RUN_LOG_NAME + ".gz")
    gz.parent.mkdir()
    with open(plain, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(plain.parent / DETAIL_NAME, gz.parent / DETAIL_NAME)  # kept as it is, next to the .gz
    assert main(["report", str(plain.parent)]) == 0
    expected = capsys.readouterr().out.replace(str(plain), str(gz))
    for where in (gz, gz.parent):  # the file, or the run directory holding only the .gz
        assert main(["report", str(where)]) == 0
        assert capsys.readouterr().out == expected
    # Cut short (compressed while it was still written): the whole lines are read, the end is flagged.
    # With the side file whole, no step is lost.
    data = gz.read_bytes()
    gz.write_bytes(data[: len(data) * 2 // 3])
    run = read_run(str(gz))
    assert run.truncated and run.corrupt == 0
    assert run.steps.size == 40


def test_a_log_in_another_compression_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / (RUN_LOG_NAME + ".zst")
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    assert main(["leaks", str(path)]) == 2
    assert capsys.readouterr().err == (f"rankmem leaks: error: {path} is zstd-compressed: rankmem reads plain and "
                                       f"gzip'd run logs; decompress it first (unzstd -k {path})\n")


@pytest.mark.parametrize("command", [["report"], ["report", "--json"], ["leaks", "-v"], ["watch", "--once"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path: Path, command: list[str]) -> None:
    """`rankmem report RUN | head -1` where the reader has left before the output is written: exit 0
    and nothing on stderr (rich's own answer to a closed pipe was exit 1; Python's, a traceback)."""
    known_run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "rankmem", command[0], str(tmp_path), *command[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader leaves first: the command's first write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, "")
