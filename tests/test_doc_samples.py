"""Every sample of output in README.md and docs/ is what its command prints today.

A sample is a ``text`` block right after a line ``<!-- sample: COMMAND -->``. The command runs as
README's commands do (``tests/test_readme_commands.py``: the same fresh directory with a short
``runs/demo``, whose ``rankmem train`` output is kept), and its output must match the sample line for
line; numbers may differ (they are the run's), and so may the runs of spaces that align columns and the
directory a path starts from. A sample whose last line is ``...`` shows the output's first lines.

After a change of output: ``python -m tests.test_doc_samples --update`` writes each sample anew from
its command's output (then read the diff: a sample should still teach what the text around it says).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DEMO_COMMAND, REPO, command_env, make_demo_workdir
from tests.test_readme_commands import PAGES, TIMEOUT_S, _argv, readme_commands

_SAMPLE = re.compile(r"<!-- sample: (.+?) -->\n```text\n(.*?)```\n", re.S)
_TEXT = re.compile(r"(<!-- (?:sample|not output): .+? -->\n)?```text\n", re.S)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?\*?")  # with the worst rank's mark
_PATH_TO_RUNS = re.compile(r"\S*/(?=runs/)")
_RULE = re.compile(r"─+")  # a table's rule: as wide as its columns


def samples() -> list[tuple[Path, str, str]]:
    return [(page, command, text) for page in PAGES for command, text in _SAMPLE.findall(page.read_text())]


def shape(text: str) -> list[str]:
    """The lines as a reader compares them: numbers, alignment, rules' widths and the path up to ``runs/``
    set aside."""
    lines = (_RULE.sub("─", _PATH_TO_RUNS.sub("", _NUMBER.sub("#", line))) for line in text.strip("\n").splitlines())
    return [" ".join(line.split()) for line in lines]


def matches(got: list[str], want: list[str]) -> bool:
    """Whether ``got`` is ``want``, where a line ``...`` in ``want`` stands for any lines (none too)."""
    parts = [list(group) for group in "\n".join(want).split("...")]
    parts = [[line for line in "".join(group).split("\n") if line] for group in parts]
    at = 0
    for i, part in enumerate(parts):
        free = i > 0  # after a "...": anywhere from here on
        found = next((j for j in range(at, len(got) - len(part) + 1) if got[j:j + len(part)] == part), None) \
            if free else (at if got[:len(part)] == part else None)
        if found is None:
            return False
        at = found + len(part)
    return at == len(got) or len(parts) > 1 and not parts[-1]


def output_of(command: str, workdir: Path, launch: Callable[[list[str]], Any] | None = None) -> str:
    if command == DEMO_COMMAND:
        return (workdir / "train.out").read_text()
    _make_its_run(command, workdir, launch)
    done = subprocess.run(_argv(command), cwd=workdir, env=command_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def _make_its_run(command: str, workdir: Path, launch: Callable[[list[str]], Any] | None) -> None:
    """A run the command reads that the demo directory lacks is made as README's own command makes it
    (by ``launch``, the session's one launch of it, where given)."""
    for run in re.findall(r"\bruns/\w+", command):
        if launch is None and (workdir / run).exists():
            continue
        train = next((c for c in readme_commands() if c.startswith("rankmem train ") and f"--out {run}" in c), None)
        if train is None:  # runs/demo: the demo directory's own
            continue
        done = launch(_argv(train)) if launch is not None else subprocess.run(
            _argv(train), cwd=workdir, env=command_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]


def test_every_text_block_is_a_sample_or_says_why_not() -> None:
    unmarked = [f"{page.name}: block {i}" for page in PAGES
                for i, m in enumerate(_TEXT.finditer(page.read_text())) if m[1] is None]
    assert unmarked == []


def test_the_pages_show_samples() -> None:
    shown = {command.split()[1] for _, command, _ in samples() if command.startswith("rankmem ")}
    assert {"train", "report", "advise"} <= shown, shown


@pytest.mark.parametrize("page,command,sample", samples(),
                         ids=[f"{p.name}:{c}" for p, c, _ in samples()])
def test_a_sample_is_its_commands_output(page: Path, command: str, sample: str, demo_workdir: Path,
                                        once_in_demo: Any) -> None:
    got = shape(output_of(command, demo_workdir, once_in_demo))
    assert matches(got, shape(sample)), f"{page.name}: {command}\n" + "\n".join(got)


def _update() -> None:
    """Writes every sample from its command's output, in a directory made as the tests make it."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="doc-samples-"))
    make_demo_workdir(work)
    for page in PAGES:
        text = page.read_text()
        new = _SAMPLE.sub(lambda m: _rewritten(m[1], m[2], work), text)
        if new != text:
            page.write_text(new)
            print(f"updated {page.relative_to(REPO)}")


def _rewritten(command: str, sample: str, work: Path) -> str:
    out = output_of(command, work)
    if sample.startswith("...\n") or "\n...\n" in sample.rstrip("\n")[:-4]:  # an excerpt: kept as written
        return f"<!-- sample: {command} -->\n```text\n{sample}```\n"
    if sample.rstrip("\n").endswith("\n..."):  # the same number of first lines
        out = "\n".join(out.splitlines()[:len(sample.rstrip("\n").splitlines()) - 1] + ["..."]) + "\n"
    return f"<!-- sample: {command} -->\n```text\n{out}```\n"


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    _update()
