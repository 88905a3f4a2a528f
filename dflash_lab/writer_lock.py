"""One writer per output directory: a lock file taken before anything is written. The lock is a
JSON record (host, pid, start time, command, directory) created with ``O_EXCL``; a stale one
(dead or recycled pid, an expired ``lease_s`` on another host, a copy from another directory) is
taken over with a message; only global rank 0 takes it. Standard library only (the exporter uses
it) (docs/guarantees.md, "One writer per output directory").
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from dflash_lab.launch import is_global_zero

#: The lock file inside a directory the command writes in place.
LOCK_NAME = ".dflash-lock"
#: Seconds without a refresh after which another host's lock counts as abandoned.
LEASE_S = 600.0


class DirectoryBusy(ValueError):
    """Another live process holds the directory's lock (ValueError: one ``error:`` line, exit 2)."""


def lock_path_for(directory: Path, *, beside: bool = False) -> Path:
    """``DIR/.dflash-lock``, or ``PARENT/.DIR.dflash-lock`` for a directory that is replaced
    whole by a rename (an export's OUT_DIR), where a lock inside would be renamed away."""
    directory = Path(directory)
    return (directory.parent / f".{directory.name}{LOCK_NAME}" if beside
            else directory / LOCK_NAME)


def _process_start(pid: int) -> str | None:
    """Kernel start time of ``pid`` (/proc/PID/stat field 22, or None): differs if recycled."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (another user's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read(path: Path) -> dict | None:
    """The lock's record; None when it vanished; {} when unparsable (being written, or damaged)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def abandoned(record: dict, path: Path, directory: Path) -> str | None:
    """Why the lock ``record`` at ``path`` no longer holds ``directory`` (None: it holds)."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "it is gone"
    if not record:
        return "it cannot be read" if age > 5.0 else None  # a writer may be mid-write
    if record.get("directory") not in (None, str(Path(directory).absolute())):
        return f"it was taken for {record['directory']} (this directory is a copy)"
    pid, lease = record.get("pid"), float(record.get("lease_s") or LEASE_S)
    if record.get("host") == socket.gethostname() and isinstance(pid, int):
        if not pid_alive(pid):
            return f"its process (pid {pid}) is gone"
        start = _process_start(pid)
        if record.get("pid_start") and start and start != record["pid_start"]:
            return f"pid {pid} is another process now"
        return None
    if age > lease:
        return f"it has not been refreshed for {age:.0f} s (lease {lease:.0f} s)"
    return None


def _busy(record: dict, path: Path, directory: Path, what: str) -> DirectoryBusy:
    holder = (f"{record.get('command') or 'a dflash-lab command'} (pid {record.get('pid')} on "
              f"{record.get('host')}, since {record.get('started')})" if record
              else "a process that is writing its lock now")
    lease = float(record.get("lease_s") or LEASE_S)
    return DirectoryBusy(
        f"{what} {directory} is being written by another process: {holder}. Wait for it to "
        f"finish or choose another {what}. Its lock is {path}; a lock left by a killed process "
        "is taken over by the next run (on this host once its pid is gone, from another host "
        f"once it has not been refreshed for {lease:.0f} s)")


def _create(path: Path, record: dict) -> bool:
    """Create the lock with ``record``; False when a lock file is already there."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def acquire(directory: Path, path: Path, record: dict, what: str) -> None:
    """Take the lock at ``path`` or raise :class:`DirectoryBusy`; an abandoned lock is renamed
    aside (one taker wins the rename) and replaced, with a message on stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(50):
        if _create(path, record):
            return
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        why = abandoned(holder, path, directory)
        if why is None:
            if holder:
                raise _busy(holder, path, directory, what)
            time.sleep(0.1)  # being written: read it again
            continue
        aside = path.with_name(f"{path.name}.stale-{record['token']}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue  # another process took it over first
        aside.unlink(missing_ok=True)
        print(f"{what} {directory}: taking over the lock of {holder.get('command') or 'a run'} "
              f"(pid {holder.get('pid')} on {holder.get('host')}): {why}", file=sys.stderr)
    raise _busy(_read(path) or {}, path, directory, what)


def release(path: Path, token: str) -> None:
    """Remove the lock if it is still ours (never another process's)."""
    record = _read(path)
    if record and record.get("token") == token:
        path.unlink(missing_ok=True)


def _heartbeat(path: Path, token: str, every: float, stop: threading.Event) -> None:
    """Touch the lock every ``every`` seconds while it is ours (another host reads the mtime)."""
    while not stop.wait(every):
        record = _read(path)
        if not record or record.get("token") != token:
            return
        try:
            os.utime(path)
        except OSError:
            return


@contextmanager
def writer_lock(directory: str | Path, *, what: str, beside: bool = False,
                command: str | None = None, lease_s: float = LEASE_S,
                env: dict | None = None) -> Iterator[Path | None]:
    """Hold ``directory``'s writer lock for the block; yields its path (None off global rank 0,
    which alone locks). ``what``: the setting that named the directory, for the message;
    ``beside``: the lock lives beside the directory (:func:`lock_path_for`)."""
    if not is_global_zero(env):
        yield None
        return
    directory = Path(directory)
    path = lock_path_for(directory, beside=beside)
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "pid_start": _process_start(os.getpid()),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "directory": str(directory.absolute()), "lease_s": lease_s, "token": uuid.uuid4().hex}
    made = _missing_dirs(path.parent)
    try:
        acquire(directory, path, record, what)
    except BaseException as err:
        _remove_if_empty(made)  # a refusal leaves no folder behind
        if isinstance(err, OSError):
            raise ValueError(f"{what}={directory} cannot be written: {err.strerror} "
                             f"({err.filename}); choose a {what} this user can write, or fix "
                             "its permissions") from err
        raise
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, record["token"], lease_s / 5, stop),
                            daemon=True)
    beat.start()
    try:
        yield path
    finally:
        stop.set()
        release(path, record["token"])
        _remove_if_empty(made)


def _missing_dirs(directory: Path) -> list[Path]:
    """``directory`` and its ancestors that do not exist yet, innermost first."""
    return list(itertools.takewhile(lambda d: not d.exists(), (directory, *directory.parents)))


def _remove_if_empty(made: list[Path]) -> None:
    """Remove the directories the lock created that are still empty (a command refused before
    it wrote anything leaves no directory behind), innermost first."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            return
