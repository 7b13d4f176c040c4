"""The failure boundaries of rankmem.core.guard: the package holds no broad handler but the documented
ones (found with ``ast``), the guard's scopes let through what they should, and each kind of boundary
(a background thread, a signal handler, an optional import) gives one warning and carries on."""

from __future__ import annotations

import ast
import os
import re
import signal
import warnings
from pathlib import Path

import pytest

from rankmem.core import guard as guard_module
from rankmem.core.guard import Guard, load_optional
from rankmem.errors import RankmemError
from tests.conftest import REPO

PACKAGE = REPO / "rankmem"
BROAD = ("Exception", "BaseException")


def _broad(node: ast.expr | None) -> bool:
    """``except:``, ``except Exception``, ``except (OSError, BaseException)``, ``builtins.Exception``."""
    if node is None:
        return True
    if isinstance(node, ast.Tuple):
        return any(_broad(e) for e in node.elts)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in BROAD


def _reraises(handler: ast.ExceptHandler) -> bool:
    """A clean-up that ends by re-raising what it caught: not a boundary."""
    last = handler.body[-1]
    return isinstance(last, ast.Raise) and last.exc is None


class _BroadHandlers(ast.NodeVisitor):
    """``(function's qualified name, line)`` of each broad handler (and ``suppress(Exception)``) in a module."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.found: list[tuple[str, int]] = []
        self.reraising: list[tuple[str, int]] = []

    def _nested(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.names.append(node.name)
        self.generic_visit(node)
        self.names.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def _where(self) -> str:
        return ".".join(self.names) or "<module>"

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if _broad(node.type):
            (self.reraising if _reraises(node) else self.found).append((self._where(), node.lineno))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "suppress" and any(_broad(a) for a in node.args):
            self.found.append((self._where(), node.lineno))
        self.generic_visit(node)


def _scan() -> tuple[dict[str, list[int]], list[str]]:
    """Per ``file: function`` the lines of its broad handlers, and the re-raising clean-ups."""
    found: dict[str, list[int]] = {}
    reraising: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = _BroadHandlers()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        rel = path.relative_to(PACKAGE).as_posix()
        for where, line in visitor.found:
            found.setdefault(f"{rel}: {where}", []).append(line)
        reraising += [f"{rel}:{line} ({where})" for where, line in visitor.reraising]
    return found, reraising


def _documented() -> set[str]:
    doc = guard_module.__doc__ or ""
    listed = doc[doc.index("The boundaries"):doc.index("Not boundaries")]
    return set(re.findall(r"``([\w/]+\.py: [\w.]+)``", listed))


def test_every_broad_handler_is_a_documented_boundary() -> None:
    found, _ = _scan()
    undocumented = {f"{where} (line {', '.join(map(str, lines))})" for where, lines in found.items()
                    if where not in _documented()}
    assert not undocumented, ("a broad handler outside the boundaries rankmem.core.guard's docstring lists: route it "
                              f"through Guard (or attempt / load_optional), or catch the types that occur: "
                              f"{undocumented}")


def test_every_documented_boundary_is_in_the_code() -> None:
    found, _ = _scan()
    assert _documented() == set(found), "rankmem.core.guard's list of boundaries and the code disagree"


def test_the_scan_sees_each_kind_of_broad_handler(tmp_path: Path) -> None:
    source = ("import contextlib\n"
              "def a():\n    try: pass\n    except: pass\n"
              "class B:\n    def c(self):\n        try: pass\n        except (OSError, BaseException): pass\n"
              "def d():\n    with contextlib.suppress(Exception): pass\n"
              "def e():\n    try: pass\n    except BaseException:\n        print()\n        raise\n"
              "def f():\n    try: pass\n    except (OSError, ValueError): pass\n")
    visitor = _BroadHandlers()
    visitor.visit(ast.parse(source))
    assert visitor.found == [("a", 4), ("B.c", 8), ("d", 10)]
    assert visitor.reraising == [("e", 13)]


def test_the_re_raising_clean_ups_are_the_ones_the_docstring_names() -> None:
    _, reraising = _scan()
    files = {r.split(":")[0] for r in reraising}
    assert files == {"windows.py", "core/rundir.py", "integrations/hf.py", "ray/cluster.py"}, reraising


# ---- the scopes ----------------------------------------------------------------------------------

def test_scope_ends_a_failure_with_one_warning_and_lets_a_user_error_through() -> None:
    guard = Guard()
    scope = guard.scope("probe", "the probe failed")
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            with scope:
                raise OSError("gone")
    assert [str(w.message) for w in caught] == ["rankmem: the probe failed: OSError('gone')"]
    assert guard.failures == 3 and isinstance(scope.error, OSError)
    with scope:
        pass
    assert scope.error is None
    with pytest.raises(RankmemError, match="every rank meets it"):
        with scope:
            raise RankmemError("every rank meets it")
    with pytest.raises(KeyboardInterrupt):
        with scope:
            raise KeyboardInterrupt


def test_contain_ends_a_user_error_too_but_not_an_interrupt() -> None:
    guard = Guard()
    with pytest.warns(RuntimeWarning, match=r"^rankmem: the watch failed: RankmemError\('bad option'\)$"):
        with guard.contain("watch", "the watch failed") as scope:
            raise RankmemError("bad option")
    assert isinstance(scope.error, RankmemError)
    with pytest.raises(SystemExit):
        with guard.contain("watch", "the watch failed"):
            raise SystemExit(3)


def test_call_returns_the_default_once_warned() -> None:
    guard = Guard()

    def boom() -> int:
        raise ValueError("no figure")

    with pytest.warns(RuntimeWarning, match="reading failed: ValueError"):
        assert guard.call("read", "reading failed", boom, default=-1) == -1
    with pytest.raises(RankmemError):
        guard.call("read", "reading failed", _user_error, default=-1)


def _user_error() -> int:
    raise RankmemError("sinks=('nope',)")


def test_load_optional_returns_what_a_broken_install_raised() -> None:
    def broken() -> object:
        raise AttributeError("module 'numpy' has no attribute 'float'")  # a package built for another numpy

    value, error = load_optional(broken)
    assert value is None and isinstance(error, AttributeError)
    value, error = load_optional(lambda: os)
    assert value is os and error is None


# ---- a signal handler's flush ---------------------------------------------------------------------

def test_a_failing_flush_at_a_signal_warns_once_and_the_signal_still_acts(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankmem.publish import signals

    monkeypatch.setattr(signals, "_guard", Guard())  # its once-per-topic starts afresh
    acted: list[int] = []

    def flush(timeout: float) -> None:
        raise RankmemError("the run directory is another job's")  # even a user error: no caller to tell

    handler = signals._handler(signal.SIGTERM, lambda signum, frame: acted.append(signum), flush)
    with pytest.warns(RuntimeWarning) as caught:
        handler(signal.SIGTERM, None)
        handler(signal.SIGTERM, None)
    assert acted == [signal.SIGTERM, signal.SIGTERM]
    assert [str(w.message) for w in caught] == [
        "rankmem: flushing the run log at SIGTERM failed: RankmemError(\"the run directory is another job's\")"]


def test_a_flush_that_works_warns_nothing() -> None:
    from rankmem.publish import signals

    flushed: list[float] = []
    handler = signals._handler(signal.SIGINT, lambda signum, frame: None, flushed.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handler(signal.SIGINT, None)
    assert flushed == [signals.FLUSH_S]
