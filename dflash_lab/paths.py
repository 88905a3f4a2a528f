"""Where the Hydra configs live, found the same way from a checkout or an installed package;
and the one way outputs are written: under a temporary name beside the output, then renamed
onto it (files: :func:`atomic_path`, :func:`atomic_write_text`; directories: :func:`atomic_dir`,
or its two steps :func:`temp_dir_beside` and :func:`publish_dir`). Imports only the standard
library: dflash_lab.export (no Lightning, no Hydra) may use it."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


#: Absolute path of the Hydra config directory (conf/capture.yaml, conf/target/, ...):
#: ``$DFLASH_LAB_CONF`` if set, else the repository's ``conf/`` beside the package.
CONF_DIR = (Path(os.environ["DFLASH_LAB_CONF"]).resolve() if os.environ.get("DFLASH_LAB_CONF")
            else REPO_ROOT / "conf")


#: Ready experiments selected with ``recipe=NAME`` (conf/recipe links here).
RECIPES_DIR = REPO_ROOT / "recipes"


def temp_beside(path: Path) -> Path:
    """A temporary name beside ``path`` for write-then-rename, unique to this process: ranks of a
    job write some files at the same moment (a capture plan, the demo data, a merged manifest);
    with one shared name a rank renames the other's half-written file, then fails its rename."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


@contextmanager
def atomic_path(path: str | Path, *, temp: Path | None = None,
                finish: Callable[[Path, Path], None] = os.replace) -> Iterator[Path]:
    """Yield a temporary name beside ``path`` to write; a clean exit runs ``finish(temp, path)``
    (default ``os.replace``: readers see the old file or the whole new one), an error removes it.
    ``temp``: a name writers share (every rank writes one sharded checkpoint; default
    :func:`temp_beside`, per process); a directory an error leaves there is kept (other ranks may
    still write it). ``finish``: a last step ending in the rename (fsync, checksum, rotation)."""
    path = Path(path)
    tmp = temp_beside(path) if temp is None else Path(temp)
    try:
        yield tmp
        finish(tmp, path)
    except BaseException:
        if not tmp.is_dir():
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------ directories
def temp_dir_prefix(path: Path) -> str:
    """``.NAME.tmp-<host>-<pid>-``: this process's temporary directories beside ``path`` (hidden;
    host and pid name the owner once it is gone: ``dflash_lab.export.outdir.stale_temp_dirs``)."""
    return f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def remove_path(path: Path) -> None:
    """Delete ``path``: a tree, file or symlink (never its target); nothing if it does not exist."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _occupied(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _always(_existing: Path) -> bool:
    return True


@contextmanager
def temp_dir_beside(path: str | Path) -> Iterator[Path]:
    """Yield a new empty directory beside ``path`` (:func:`temp_dir_prefix` + a random tail, so
    concurrent builders never share one; a plain ``mkdir``, so the umask's mode, not
    ``mkdtemp``'s 0700), and delete it on exit unless it was moved away (:func:`publish_dir`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{temp_dir_prefix(path)}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        remove_path(tmp)


def publish_dir(tmp: Path, path: str | Path,
                replace_existing: Callable[[Path], bool] = _always) -> bool:
    """Rename the finished directory ``tmp`` onto ``path``; True when it is there. Where ``path``
    exists (or another builder's rename won), ``replace_existing(path)`` decides: True moves the
    old one aside (``.NAME.old-<random>``), renames ``tmp`` in, then deletes the old (readers see
    old or new whole); False keeps both (an equal result is there); it may raise to refuse. A
    rename failing otherwise puts the old one back."""
    path = Path(path)
    while True:
        old = None
        if _occupied(path):
            if not replace_existing(path):
                return False
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:
            if _occupied(path):
                continue  # another builder placed its directory first: decide again
            if old is not None:
                os.rename(old, path)
                old = None
            raise
        finally:
            if old is not None:
                remove_path(old)
        return True


@contextmanager
def atomic_dir(path: str | Path, replace_existing: Callable[[Path], bool] = _always
               ) -> Iterator[Path]:
    """Yield a new empty directory beside ``path`` to build in; on a clean exit it becomes
    ``path`` (:func:`publish_dir`, ``replace_existing`` deciding about an existing ``path``),
    on an error it is deleted. A crash never leaves a half-built ``path``."""
    with temp_dir_beside(path) as tmp:
        yield tmp
        publish_dir(tmp, path, replace_existing)
