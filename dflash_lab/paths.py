"""Where the Hydra configs live, found the same way from a checkout or an installed package;
and the one way files are written (temporary name beside the file, then rename).

Imports only the standard library: export/ (no Lightning, no Hydra) may use it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent


def _find_conf_dir() -> Path:
    """``$DFLASH_LAB_CONF`` if set, else the repository's ``conf/`` beside the package."""
    env = os.environ.get("DFLASH_LAB_CONF")
    if env:
        return Path(env).resolve()
    return REPO_ROOT / "conf"


#: Absolute path of the Hydra config directory (conf/capture.yaml, conf/target/, ...).
CONF_DIR = _find_conf_dir()


#: Ready experiments selected with ``recipe=NAME`` (conf/recipe links here).
RECIPES_DIR = REPO_ROOT / "recipes"


def temp_beside(path: Path) -> Path:
    """A temporary name beside ``path`` for write-then-rename, unique to this process. Ranks of
    a job, on one node or several, write some files at the same moment (a capture plan, the demo
    data, a manifest that two ranks finishing together both merge); with one shared temporary
    name a rank renames the other's half-written file and then fails its own rename."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside ``path`` (:func:`temp_beside`) to write; on a clean
    exit rename it onto ``path`` (``os.replace``, atomic on one filesystem), on an error remove
    it. Readers see the old file or the whole new one, never half of it."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
