"""The layers of DESIGN.md: online code never imports offline code, the offline tools need no torch, and
no import cycle runs through rankmem's modules.

Online is everything a training process runs (probe, windows, exchange, publish, sinks, integrations,
the reference worker); offline is the run-log reader, report, leaks, plot and the CLI. The static
checks parse every module's imports with ``ast`` (function-level ones too, ``if TYPE_CHECKING:``
blocks aside, since they never run); the runtime checks import in a fresh interpreter and look at
``sys.modules``, which also catches an import made on a code path rather than at the top.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.runlog_helpers import known_run

PACKAGE = REPO / "rankmem"
OFFLINE = ("rankmem.offline", "rankmem.cli")
"""The offline layer is two folders: ``offline/`` (readers, report, plot, leaks, watch) and ``cli/``."""
NOT_A_LAYER = ("rankmem.__main__",)
"""``python -m rankmem`` is the CLI's entry point, neither layer's library code."""
OPTIONAL_FRAMEWORKS = ("rankmem.integrations.hf", "rankmem.integrations.lightning")
"""Online, but they import transformers / Lightning on import (seconds each): checked statically only."""
FOLDER_RULES = {
    "rankmem.core": ("rankmem.probe", "rankmem.windows", "rankmem.exchange", "rankmem.publish", "rankmem.sinks",
                     "rankmem.runlog", "rankmem.forensics", "rankmem.trend", "rankmem.offline", "rankmem.cli",
                     "rankmem.engine", "rankmem.integrations", "rankmem.ray", "rankmem.monitor", "rankmem.testing"),
    "rankmem.probe": ("rankmem.publish", "rankmem.forensics", "rankmem.offline", "rankmem.exchange",
                      "rankmem.monitor", "rankmem.sinks", "rankmem.runlog"),
    "rankmem.exchange": ("rankmem.publish", "rankmem.forensics", "rankmem.offline", "rankmem.monitor",
                         "rankmem.sinks", "rankmem.runlog", "rankmem.windows"),
    "rankmem.fit": ("rankmem.probe", "rankmem.windows", "rankmem.exchange", "rankmem.publish", "rankmem.sinks",
                    "rankmem.runlog", "rankmem.forensics", "rankmem.trend", "rankmem.offline", "rankmem.cli",
                    "rankmem.engine", "rankmem.integrations", "rankmem.ray", "rankmem.monitor"),
    "rankmem.trend": ("rankmem.publish", "rankmem.forensics", "rankmem.offline", "rankmem.exchange",
                      "rankmem.monitor", "rankmem.probe", "rankmem.windows"),
}
"""Per folder, the folders (and modules) it must never import: ``core/`` imports nothing above it; probe,
exchange and trend reach no writer, no forensics and no reader; ``fit/`` (the memory model) is pure math."""


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _is_offline(module: str) -> bool:
    return any(_under(module, o) for o in OFFLINE)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
ONLINE = sorted(m for m in MODULES if not _is_offline(m) and m not in NOT_A_LAYER)


class _Imports(ast.NodeVisitor):
    """The rankmem modules a module imports, wherever in the module (``if TYPE_CHECKING:`` aside)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the package, up level - 1
            anchor = self.package.split(".")
            base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self.found.add(sub if sub in MODULES else base)


def _graph() -> dict[str, set[str]]:
    """Module -> the rankmem modules it imports. Imports of the root package itself are left out: it is
    the public facade that re-exports the layers, and modules reach it for ``__version__`` only."""
    graph = {}
    for module, path in MODULES.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        graph[module] = {m for m in visitor.found if m in MODULES and m not in ("rankmem", module)}
    return graph


GRAPH = _graph()


def test_the_layers_are_folders() -> None:
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["cli", "core", "engine", "exchange", "fit", "forensics", "integrations", "offline", "probe",
                       "publish", "ray", "runlog", "sinks", "trend"]
    assert _is_offline("rankmem.cli._report") and _is_offline("rankmem.offline.report")
    assert not _is_offline("rankmem.runlog.writer") and not _is_offline("rankmem.trend.trend")


@pytest.mark.parametrize("folder", sorted(FOLDER_RULES))
def test_folder_imports_nothing_above_it(folder: str) -> None:
    bad = sorted({f"{m} -> {dep}" for m in MODULES if _under(m, folder) for dep in GRAPH[m]
                  if any(_under(dep, f) for f in FOLDER_RULES[folder])})
    assert bad == [], f"{folder} imports what it must not: {bad}"


def test_nothing_inside_the_package_imports_its_face() -> None:
    """``rankmem/__init__`` re-exports the layers; a module importing it would run back up the tree."""
    facing = sorted(m for m, path in MODULES.items() if m != "rankmem" and _imports_face(path))
    assert facing == []


def _imports_face(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "rankmem" and node.level == 0:
            if any(f"rankmem.{alias.name}" not in MODULES for alias in node.names):
                return True
        if isinstance(node, ast.Import) and any(alias.name == "rankmem" for alias in node.names):
            return True
    return False


@pytest.mark.parametrize(
    "module", ONLINE)
def test_online_module_imports_no_offline_module(module: str) -> None:
    offline = sorted(m for m in GRAPH[module] if _is_offline(m))
    assert offline == [], f"{module} (online) imports {offline} (offline)"


def test_cli_report_does_not_import_the_leaks_subcommand() -> None:
    assert "rankmem.cli._leaks" not in GRAPH["rankmem.cli._report"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_rankmem_modules() -> None:
    assert _cycles(GRAPH) == []
    # The check itself finds one, function-level imports included.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = ("def f():\n    from rankmem.offline.report import build_report\nif TYPE_CHECKING:\n"
              "    import rankmem.offline.plot\n")
    visitor = _Imports("rankmem.x", False)
    visitor.visit(ast.parse(source))
    assert visitor.found == {"rankmem.offline.report"}


_ONLINE_PROCESS = """
import importlib, json, sys, tempfile

OFFLINE = {offline!r}
def offline():
    return sorted(m for m in sys.modules if any(m == o or m.startswith(o + ".") for o in OFFLINE))

for name in {modules!r}:
    importlib.import_module(name)
after_import = offline()

import rankmem
with tempfile.TemporaryDirectory() as out:
    monitor = rankmem.Monitor(out_dir=out, sinks=("jsonl", "console"), device="cpu", children=False)
    for step in range(3):
        with monitor.step(step):
            with monitor.phase("update"):
                pass
        monitor.collect({{"loss": 1.0}})
    monitor.close()
print(json.dumps({{"after_import": after_import, "after_collect": offline()}}))
"""


@pytest.fixture(scope="module")
def online_process() -> dict[str, list[str]]:
    modules = [m for m in ONLINE if m not in OPTIONAL_FRAMEWORKS]
    code = _ONLINE_PROCESS.format(offline=OFFLINE, modules=modules)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result: dict[str, list[str]] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_importing_the_online_modules_loads_no_offline_module(online_process: dict[str, list[str]]) -> None:
    assert online_process["after_import"] == []


def test_a_monitor_run_with_sinks_and_leak_watch_loads_no_offline_module(online_process: dict[str, list[str]]) -> None:
    assert online_process["after_collect"] == []


_OFFLINE_PROCESS = """
import contextlib, io, json, sys
from rankmem.cli import main

with contextlib.redirect_stdout(io.StringIO()):
    codes = [main(["report", {run!r}]), main(["leaks", {run!r}]), main(["watch", "--once", {run!r}])]
print(json.dumps({{"codes": codes, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}}))
"""


def test_the_offline_tools_run_without_torch(tmp_path: Path) -> None:
    known_run(tmp_path, leak_rank=1)
    code = _OFFLINE_PROCESS.format(run=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, 1, 0], "torch": []}
