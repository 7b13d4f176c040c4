"""The run directory: the one owner of its names, its lock, its run's identity, and the rotation of an
earlier run's files.

::

    OUT/rankmem.jsonl          the run log (header line: "run_id")
    OUT/rankmem.ranks.f64      its side file of per-rank values (file header: the run id)
    OUT/events/rank<r>.jsonl   each rank's forensic events (every line: "run_id")
    OUT/heartbeat/rank<r>.hb   each rank's heartbeat (the record holds the run id)
    OUT/tb/                    TensorBoard's event files
    OUT/torchrun.log           ``rankmem train``'s launch log
    OUT/.lock                  one job per directory (:mod:`rankmem.core.lock`)

**Identity.** Every file of a run carries its run id (:func:`current_run_id`, new for each torchrun
restart), so a reader can tell an earlier run's file from the run's own and name it.

**Rotation.** An earlier run's files are moved aside together, with one number N per earlier run
(``rankmem.jsonl.N``, ``events.N/``, ...). Per-rank files move only when they are of another run, so
every rank may rotate its own files when it starts without moving a file the current run is writing;
a file still empty is left alone.

**Files rankmem writes are regular files.** :func:`open_regular` is the one way rankmem opens a file:
without blocking (a FIFO), never through a link where it writes (``O_NOFOLLOW``), refusing anything but
a regular file (:class:`NotRegularFile`). :func:`unlinked` says that a file's directory was deleted.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["DETAIL_NAME", "ENV_RUN_ID", "EVENTS_DIR", "HEARTBEAT_DIR", "LOCK_NAME", "RUN_ID_BYTES",
           "RUN_LOG_NAME", "TB_DIR", "NotRegularFile", "RunDir", "current_run_id", "kind_of", "open_regular",
           "unlinked"]

IdReader = Callable[[str], "str | None"]

LOCK_NAME = ".lock"
ENV_HELD = "RANKMEM_RUN_LOCK"
"""Set by ``rankmem train`` for its job: the absolute path of the lock file it holds on the job's behalf."""
RUN_LOG_NAME = "rankmem.jsonl"
DETAIL_NAME = "rankmem.ranks.f64"
EVENTS_DIR = "events"
HEARTBEAT_DIR = "heartbeat"
TB_DIR = "tb"
LAUNCH_LOG_NAME = "torchrun.log"
ENV_RUN_ID = "RANKMEM_RUN_ID"
"""Set by ``rankmem train`` (and the Ray launcher) for its ranks: the job's id, shared by every rank."""
RUN_ID_BYTES = 16
"""A run id is this many ASCII characters (hex digits); a heartbeat holds it in as many bytes."""
RUN_ID_FIELD = "run_id"
_PROBE_BYTES = 1 << 16  # the first line of a log or an events file is far shorter
_MAX_SLOTS = 100_000  # rotation numbers looked at: a directory listing bounds them anyway
_RANK_FILE = re.compile(r"rank(\d{1,9})\.(jsonl|hb)")


def detail_name(log_name: str) -> str:
    """The side file's name for a run log named ``log_name`` (``rankmem.jsonl`` -> :data:`DETAIL_NAME`)."""
    stem = log_name[: -len(".jsonl")] if log_name.endswith(".jsonl") else log_name
    return f"{stem}.ranks.f64"


def current_run_id(environ: Mapping[str, str] | None = None) -> str:
    """This process's run id: the same on every rank of one job attempt, derived from what its launcher
    shares with every rank (``rankmem train``'s :data:`ENV_RUN_ID`, torchrun's run id, Slurm's job and
    step, a ``MASTER_ADDR:MASTER_PORT`` rendezvous with the parent that spawned the ranks), each with the
    restart count; a fresh random id for a process alone. (The Monitor then takes the logging rank's id
    at the first collect, so ranks that found no shared source agree from there on.)"""
    env = os.environ if environ is None else environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or "0"
    if env.get(ENV_RUN_ID):
        source = f"rankmem:{env[ENV_RUN_ID]}"
    elif env.get("TORCHELASTIC_RUN_ID"):
        source = f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    elif env.get("SLURM_JOB_ID"):
        source = f"slurm:{env['SLURM_JOB_ID']}:{env.get('SLURM_STEP_ID')}"
    elif env.get("MASTER_PORT") and int(_digits(env.get("WORLD_SIZE")) or 1) > 1:
        source = f"spawn:{env.get('MASTER_ADDR')}:{env['MASTER_PORT']}:{os.getppid()}"
    else:
        return _alone()
    import hashlib  # here: `rankmem report` never makes a run id (imports are its time)

    return hashlib.sha256(f"{source}:{attempt}".encode()).hexdigest()[:RUN_ID_BYTES]


_ALONE: list[str] = []


def _alone() -> str:
    # One id per process: every Monitor of a process alone is one run (its files rotate by the log).
    if not _ALONE:
        _ALONE.append(os.urandom(RUN_ID_BYTES // 2).hex())
    return _ALONE[0]


def _digits(text: str | None) -> str:
    return text if text is not None and text.isdigit() and len(text) < 10 else ""


def valid_run_id(value: object) -> str | None:
    """``value`` when it is a run id as written (ASCII hex digits), else None."""
    if isinstance(value, str) and len(value) == RUN_ID_BYTES and all(c in "0123456789abcdef" for c in value):
        return value
    return None


# ---- files rankmem opens ----------------------------------------------------------------------------
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


class NotRegularFile(OSError):
    """What rankmem opened (or found) is not a regular file; its message says what it is."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file; rankmem reads and writes "
                                       "regular files only (move it aside)")
        self.path = path  # not OSError's filename: with it set, str() would repeat the path
        self.kind = kind

    def __str__(self) -> str:
        return str(self.strerror)


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """``os.open`` for every file rankmem reads or writes: never blocks (``O_NONBLOCK``: a FIFO with no
    writer opens at once), never follows a link where it writes (``O_NOFOLLOW``), and refuses anything
    but a regular file with :class:`NotRegularFile` (an OSError). ``mode`` goes through the umask."""
    nofollow = os.O_NOFOLLOW if flags & _WRITES else 0
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and nofollow and os.path.islink(path):
            raise NotRegularFile(path, "a symbolic link") from None
        raise
    try:
        kind = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise NotRegularFile(path, kind_of(kind))
    return fd


def open_binary(path: str) -> io.BufferedReader:
    """``open(path, "rb")``, through :func:`open_regular`."""
    return io.open(open_regular(path), "rb")  # noqa: UP020 - typed as a BufferedReader, which peeks


def is_regular(path: str) -> bool:
    """Whether ``path`` is a regular file (``os.stat`` never blocks)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file beside it, renamed over it once
    written and flushed. Only a regular file or a new path is replaced (:class:`NotRegularFile` for a
    link, a device...: left untouched); the mode is the replaced file's own, else what the umask gives."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        mode = 0o666 & ~mask
    else:
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, kind_of(st.st_mode))
        mode = stat.S_IMODE(st.st_mode)
    import tempfile

    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def unlinked(fd: int) -> bool:
    """The open file was deleted (its directory removed, say): what is written to it is lost."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def head(path: str, size: int = _PROBE_BYTES) -> bytes | None:
    """The first ``size`` bytes of a regular file, None when it is not one or cannot be read."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def jsonl_run_id(path: str) -> str | None:
    """The run id in the first line of a JSON Lines file of a run (the log's header, an event); None
    when it has none (an older rankmem wrote it) or cannot be read."""
    data = head(path)
    if not data:
        return None
    first = data.split(b"\n", 1)[0]
    try:
        obj = json.loads(first)
    except ValueError:
        return None
    return valid_run_id(obj.get(RUN_ID_FIELD)) if isinstance(obj, dict) else None


@dataclass(frozen=True, slots=True)
class Moved:
    """One entry of an earlier run moved aside."""

    path: str
    to: str


class RunDir:
    """The run directory at ``root``; ``log_name`` names its run log (the side file's name follows)."""

    def __init__(self, root: str, log_name: str = RUN_LOG_NAME) -> None:
        self.root = os.path.abspath(root)
        self.log_name = log_name
        self.log = os.path.join(self.root, log_name)
        self.detail = os.path.join(self.root, detail_name(log_name))
        self.events = os.path.join(self.root, EVENTS_DIR)
        self.heartbeat = os.path.join(self.root, HEARTBEAT_DIR)
        self.tb = os.path.join(self.root, TB_DIR)
        self.lock_path = os.path.join(self.root, LOCK_NAME)
        self.launch_log = os.path.join(self.root, LAUNCH_LOG_NAME)
        """``rankmem train``'s copy of everything torchrun and the ranks wrote to stderr."""

    @classmethod
    def of_log(cls, log_path: str) -> RunDir:
        """The run directory of the run log at ``log_path`` (any name)."""
        directory, name = os.path.split(os.path.abspath(log_path))
        return cls(directory, name)

    @staticmethod
    def events_of(run: str) -> str:
        """The events directory of a run directory, or of the run log at ``run``: a rotated log
        (``rankmem.jsonl.N``, ``.N.gz`` too) has its run's events in ``events.N``."""
        if not os.path.isfile(run):
            return os.path.join(run, EVENTS_DIR)
        directory, name = os.path.split(run)
        name = name[: -len(".gz")] if name.endswith(".gz") else name
        suffix = name.rsplit(".", 1)[-1]
        events = os.path.join(directory or ".", EVENTS_DIR)
        return f"{events}.{suffix}" if suffix.isdigit() else events

    def event_file(self, rank: int) -> str:
        return os.path.join(self.events, f"rank{rank}.jsonl")

    def heartbeat_file(self, rank: int, directory: str | None = None) -> str:
        return os.path.join(directory or self.heartbeat, f"rank{rank}.hb")

    def lock_held_by_launcher(self) -> bool:
        return os.environ.get(ENV_HELD) == self.lock_path

    # ---- rotation ------------------------------------------------------------------------------
    def rotate(self, run_id: str | None, heartbeat_id: IdReader, only: Iterable[str] | None = None
               ) -> list[Moved]:
        """Move every file of another run than ``run_id`` aside (see the module docstring); ``only``:
        just these paths (a rank's own files, at its start); ``heartbeat_id`` reads a heartbeat's run
        id. A new launch (``run_id`` None) moves the launch log too. Returns what moved, for one line
        each. Raises ``OSError`` where the directory cannot be changed (the caller warns)."""
        groups: dict[str | None, list[str]] = {}
        for path, identity in self._foreign(run_id, heartbeat_id, None if only is None else set(only)):
            groups.setdefault(identity, []).append(path)
        moved: list[Moved] = []
        for identity, paths in groups.items():
            slot = self._slot(identity, heartbeat_id)
            for path in paths:
                target = self._rotated(path, slot)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                try:
                    os.replace(path, target)
                except FileNotFoundError:  # another rank (or node) moved it first
                    continue
                moved.append(Moved(path, target))
        return moved

    def _foreign(self, run_id: str | None, heartbeat_id: IdReader, only: set[str] | None
                 ) -> list[tuple[str, str | None]]:
        out: list[tuple[str, str | None]] = []
        def wanted(path: str) -> bool:
            return only is None or path in only

        log_id = jsonl_run_id(self.log) if os.path.lexists(self.log) else None
        own = (self.log, self.detail) + ((self.launch_log,) if run_id is None else ())
        for path, identity in ((p, log_id) for p in own):
            # The log and its side file move whatever their identity (it only picks the slot): a second
            # Monitor of the same attempt must not truncate the first one's log.
            if wanted(path) and os.path.lexists(path) and not _being_created(path):
                out.append((path, identity))
        for directory, read in ((self.events, jsonl_run_id), (self.heartbeat, heartbeat_id)):
            if not os.path.lexists(directory):
                continue
            if not os.path.isdir(directory) or os.path.islink(directory):
                if wanted(directory):
                    out.append((directory, None))  # a plain file where the directory belongs
                continue
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                if not _RANK_FILE.fullmatch(name) or not wanted(path) or _being_created(path):
                    continue
                identity = read(path)
                if not _ours(identity, run_id):
                    out.append((path, identity))
        return out

    def _rotated(self, path: str, slot: int) -> str:
        parent, name = os.path.split(path)
        if parent in (self.events, self.heartbeat):
            return os.path.join(f"{parent}.{slot}", name)
        return f"{path}.{slot}"

    def _slot(self, identity: str | None, heartbeat_id: IdReader) -> int:
        """The rotation number of the run ``identity``: where its files already went, else the first free."""
        used: set[int] = set()
        prefixes = [os.path.basename(p) + "." for p in (self.log, self.detail, self.launch_log, self.events,
                                                         self.heartbeat)]
        try:
            names = os.listdir(self.root)
        except OSError:
            names = []
        for name in names:
            for prefix in prefixes:
                number = name[len(prefix):] if name.startswith(prefix) else ""
                if number.isdigit() and len(number) < 7:
                    used.add(int(number))
        if identity is not None:
            for n in sorted(used):
                if identity in self._slot_ids(n, heartbeat_id):
                    return n
            # A slot whose names exist but hold nothing yet is another rank's rotation of this same run
            # under way (it makes the directory, then moves the files in): taking the next number there
            # split one run's files over two slots (a torchrun restart's rank 1 events in events.2).
            for n in sorted(used):
                if self._slot_empty(n):
                    return n
        n = 1
        while n in used and n < _MAX_SLOTS:
            n += 1
        return n

    def _slot_empty(self, n: int) -> bool:
        """No file under slot ``n``: neither a rotated log nor side file, and its directories empty."""
        if any(os.path.lexists(f"{path}.{n}") for path in (self.log, self.detail, self.launch_log)):
            return False
        for directory in (f"{self.events}.{n}", f"{self.heartbeat}.{n}"):
            try:
                if os.listdir(directory):
                    return False
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return True

    def _slot_ids(self, n: int, heartbeat_id: IdReader) -> set[str | None]:
        ids: set[str | None] = {jsonl_run_id(f"{self.log}.{n}")}
        for directory, read in ((f"{self.events}.{n}", jsonl_run_id), (f"{self.heartbeat}.{n}", heartbeat_id)):
            try:
                names = os.listdir(directory)[:64]
            except OSError:
                continue
            ids.update(read(os.path.join(directory, name)) for name in names)
        ids.discard(None)
        return ids


def _ours(identity: str | None, run_id: str | None) -> bool:
    return run_id is not None and identity == run_id


def _being_created(path: str) -> bool:
    """An empty regular file: a rank has just created it and not yet written its identity (or an
    earlier run left nothing in it, which is nothing to keep either)."""
    try:
        st = os.lstat(path)
    except OSError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_nlink == 1  # a hard link is not ours


def rotated_lines(moved: list[Moved]) -> list[str]:
    """One line per destination (a directory's per-rank files together): a restart is normal, the
    earlier run's records are kept."""
    by_target: dict[str, str] = {}
    logs = {m.to.rsplit(".", 1)[-1] for m in moved if m.path.endswith(".jsonl")}
    for m in moved:
        if m.path.endswith(".ranks.f64") and m.to.rsplit(".", 1)[-1] in logs:
            continue  # the side file goes with its log: one line says both
        in_dir = os.path.basename(os.path.dirname(m.path)) in (EVENTS_DIR, HEARTBEAT_DIR)
        source, target = (os.path.dirname(m.path), os.path.dirname(m.to)) if in_dir else (m.path, m.to)
        by_target.setdefault(target, source)
    return [f"{source} was from an earlier run (a restart into the same out_dir?); rotated it to {target}"
            for target, source in by_target.items()]
