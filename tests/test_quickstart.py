"""README's Quick start runs as printed under torchrun and measures every rank; a Monitor built where the
launcher says several ranks and no process group exists refuses, naming the fix (issue 22, item 1)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import rankmem
from rankmem.errors import RankmemError
from tests.conftest import REPO, torchrun


def quick_start_block() -> str:
    """The first python block of README's ``## Quick start`` section, as printed."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start\n"):]
    section = section[: section.index("\n## ", 1)]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found, "README's Quick start has no python block"
    return found.group(1)


def test_readme_quick_start_runs_as_printed_on_two_torchrun_ranks(tmp_path: Path) -> None:
    script = tmp_path / "quickstart_loop.py"
    script.write_text(quick_start_block())
    done = torchrun(script, 2, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "runs" / "my_run" / "rankmem.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["world_size"] == 2 and [r["rank"] for r in header["ranks"]] == [0, 1]
    steps = [json.loads(line) for line in lines[1:]]
    assert [s["step"] for s in steps] == list(range(10))
    assert "another rankmem job" not in done.stderr
    assert re.search(r"peak RSS \d+\.\d{3} GiB on rank [01]", done.stdout), done.stdout[-2000:]


@pytest.mark.parametrize("world", ["2", "8"])
def test_a_monitor_under_a_launchers_world_without_a_process_group_refuses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, world: str) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    # What torchrun (and Ray Train, and rankmem's Ray launcher) put in every rank's environment.
    for name, value in {"WORLD_SIZE": world, "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RankmemError, match=rf"^WORLD_SIZE={world} says this job has {world} ranks, but no process "
                                           r"group is initialised: call torch.distributed.init_process_group\(\) "
                                           r"before building the Monitor"):
        rankmem.Monitor(out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything was opened or written


def test_a_world_of_one_or_no_launcher_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    rankmem.Monitor(near_oom_watch=False).close()
    monkeypatch.delenv("WORLD_SIZE")
    monitor = rankmem.Monitor(near_oom_watch=False)
    assert monitor.world_size == 1
    monitor.close()
