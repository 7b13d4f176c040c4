"""The launcher's relay of torchrun's stderr: drained for the whole job, copied to the launch log, and held
back on the terminal from a failure's first line, so that the launcher's diagnosis is printed last."""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from typing import IO

from rankmem.core.guard import Guard
from rankmem.core.rundir import open_regular

__all__ = ["StderrRelay", "first_traceback"]

TAIL_LINES = 2000  # torchrun's failure table is at the end of its stderr; keep this much to read it
# torchrun's agent logs this the moment it sees a worker fail; the failure table follows it.
FAILURE_STARTS = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: \d+\)")
# A rank's traceback, as Python prints it (torchrun prefixes each line of a rank's with "[rankN]:").
TRACEBACK = re.compile(r"^(\[[a-z]*\d+\]: ?)?Traceback \(most recent call last\):")
HOLD_S = 10.0  # a traceback no failure follows within this is a rank's logged error: shown after all
HELD_MAX = 20_000  # lines held back in memory at most (all of it goes to the launch log)


class StderrRelay:
    """Drains torchrun's stderr (its own and every rank's) for the whole job, whatever becomes of ours.

    Every line goes to the launch log and the tail is kept for the diagnosis. On the terminal, lines pass
    through until a failure starts (:meth:`hold`), then are held so that the diagnosis is printed last; a
    held traceback that no failure follows within :data:`HOLD_S` is shown after all (:meth:`tick`). The
    relay drains even when our stderr is closed, or torchrun would block on a full pipe.
    """

    def __init__(self, source: IO[bytes], sink: IO[str] | None, log_path: str | None = None) -> None:
        self._source, self._sink = source, sink
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._held: list[str] = []
        self._holding: str | None = None  # why: "traceback", "failure", "signal"
        self._held_at = 0.0
        self._since_traceback: list[str] = []  # from the first rank traceback on: the original error
        self.traceback_shown = False
        """The first traceback was shown already (released by :meth:`tick`, the job going on then)."""
        self._lock = threading.Lock()
        self.log_path = log_path
        self._log_fd: int | None = None
        if log_path is not None:
            try:
                self._log_fd = open_regular(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # rotated before
            except OSError:
                self.log_path = None
        self._thread = threading.Thread(target=self._pump, name="rankmem-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        # This thread's one job is to keep draining the pipe: a line it fails to relay is said once.
        take = Guard().contain("relay", "a line of torchrun's stderr could not be relayed (the launch log lacks it)")
        while True:
            try:
                raw = self._source.readline()
            except (OSError, ValueError):
                return
            if not raw:
                return
            with take:
                self._take(raw)

    def _take(self, raw: bytes) -> None:
        self._log(raw)
        line = raw.decode("utf-8", "replace")
        with self._lock:
            self.tail.append(line)
            if self._holding in (None, "traceback") and FAILURE_STARTS.search(line):
                self._holding = "failure"
            elif self._holding is None and TRACEBACK.match(line):
                self._holding = "traceback"
            if (self._since_traceback or TRACEBACK.match(line)) and len(self._since_traceback) < HELD_MAX:
                self._since_traceback.append(line)
            if self._holding is not None:
                self._held_at = time.monotonic()
                if len(self._held) < HELD_MAX:
                    self._held.append(line)
                return
        self._emit(line)

    def _log(self, raw: bytes) -> None:
        if self._log_fd is None:
            return
        try:
            os.write(self._log_fd, raw)
        except OSError:  # a full disk: the terminal and the tail still have it
            os.close(self._log_fd)
            self._log_fd = None

    def _emit(self, text: str) -> None:
        # Our stderr may be closed (sys.stderr is None under 2>&-), a closed pipe, a dead tee.
        if not text or self._sink is None:
            return
        try:
            self._sink.write(text)
            self._sink.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def hold(self) -> None:
        """Hold back everything from now on (a signal to the launcher: what follows is its fallout)."""
        with self._lock:
            self._holding = "signal"

    def tick(self) -> None:
        """Show a held traceback that no failure followed (see the class docstring)."""
        with self._lock:
            if self._holding != "traceback" or time.monotonic() - self._held_at < HOLD_S:
                return
            held, self._held, self._holding = self._held, [], None
            self.traceback_shown = True
        self._emit("".join(held))

    def wait(self, timeout: float) -> None:
        """Until torchrun's stderr closes (a worker that outlives torchrun may keep it open: bounded)."""
        self._thread.join(timeout)

    def text(self) -> str:
        with self._lock:
            return "".join(self.tail)

    def first_traceback_text(self) -> str:
        """Everything from the first rank traceback on (the first one is the original error: the
        others' follow from it, a collective's peer gone)."""
        with self._lock:
            return "".join(self._since_traceback)

    def release(self, text: str | None = None) -> None:
        """Write ``text`` (default: all that was held) and pass everything after it straight through."""
        with self._lock:
            held, self._held, self._holding = self._held, [], None
        self._emit("".join(held) if text is None else text)

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None


def first_traceback(text: str) -> tuple[str, str, str] | None:
    """The first rank traceback in ``text``: (its lines, its exception line, the rank's prefix)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if TRACEBACK.match(line)), None)
    if start is None:
        return None
    match = TRACEBACK.match(lines[start])
    prefix = (match[1] if match else None) or ""
    chain = ("Traceback", "During handling", "The above exception")
    block: list[str] = []
    exc = ""
    for line in lines[start:]:
        if not line.startswith(prefix):
            continue  # another rank's line, interleaved
        body = line[len(prefix):].rstrip("\n")
        top = bool(body.strip()) and not body.startswith((" ", "\t"))
        if top and exc and not body.startswith(chain):
            break  # past the traceback's exception line
        block.append(line)
        if top and not body.startswith(chain):
            exc = body.strip()
    return "".join(block), exc, prefix.strip("[]: ")
