"""docs/integrations.md's snippets are the example files (tests/test_readme_commands.py runs each one as
the page shows it and checks what it leaves behind)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", re.S)


def test_readme_blocks_equal_example_files() -> None:
    blocks = BLOCK.findall((REPO / "docs" / "integrations.md").read_text())
    assert {p for p, _ in blocks} >= {"examples/hf_example.py", "examples/lightning_example.py",
                                      "examples/verl_example.py"}
    for path, code in blocks:
        assert code == (REPO / path).read_text(), f"docs/integrations.md block differs from {path}"
