"""Bounded inputs: every number typed at the command line has a finite range (one error line, exit 2,
before any work), and a micro-batch count past any real one is refused with one warning, its window
left out of the fit, training going on."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from rankmem.cli import build_parser, main
from tests.runlog_helpers import known_run


@pytest.mark.parametrize("args", [
    ["watch", "--interval", "inf"], ["watch", "--interval", "1e300"], ["watch", "--stale", "1e20"],
    ["watch", "--frames", "99999999999"], ["plot", "--size", "60000x60000"], ["plot", "--size", "200x99999"],
    ["advise", "--capacity", "inf"], ["advise", "--headroom", "1e300"], ["advise", "--at-tokens", "1e300"],
    ["advise", "--budget", "99999999999999999999"], ["leaks", "--window=-inf"],
    ["leaks", "--last", "10000000000"],
    ["report", "--imbalance-floor-mib", "1e300"], ["leaks", "--min-growth", "inf"],
])
def test_absurd_numbers_are_one_error_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      args: list[str]) -> None:
    run = known_run(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([*args, str(run.parent)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    flag = args[1].split("=")[0]
    assert err[-1].startswith(f"rankmem {args[0]}: error: argument {flag}: must be a finite number at most")
    assert not any("Traceback" in line for line in err)


def test_every_numeric_option_of_every_subcommand_is_bounded() -> None:
    """Found by walking the parser, so an option added later is covered too (train's job options have
    their own checks)."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    numeric = 0
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.type in (None, str) or name == "train" or not action.option_strings:
                continue
            numeric += 1
            for text in ("1e300", "9" * 25, "99999x99999"):  # a float, an int, a size
                try:
                    action.type(text)  # type: ignore[misc]
                except argparse.ArgumentTypeError as exc:
                    if "must be a finite number at most" in str(exc):
                        break
                except ValueError:
                    continue
            else:
                raise AssertionError(f"rankmem {name} {action.option_strings[0]} took an absurd number")
    assert numeric >= 20


def test_micro_batch_past_any_real_count_is_refused_with_one_warning(tmp_path: Path) -> None:
    import rankmem
    from rankmem.offline import read_run

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", near_oom_watch=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, tokens in enumerate([100.0, 1e300, float("nan"), -5.0, 2.0**41, 300.0]):
            with monitor.step(step), monitor.phase("update"):
                monitor.micro_batch(tokens, 2.0)
            monitor.collect()
        monitor.close()
    told = [str(w.message) for w in caught if "micro_batch" in str(w.message)]
    assert len(told) == 1 and "1e+300" in told[0] and "left out of the advice fit" in told[0], told
    run = read_run(str(tmp_path))
    tokens = run.series["mem/phase/update/heaviest_mb_tokens"][:, 0]
    assert tokens[0] == 100.0 and tokens[5] == 300.0 and np.isnan(tokens[1:5]).all(), tokens
