"""Which OUT_DIR an export may replace (renaming it aside, then deleting it): never what it
reads (source, run directory, checkpoint; through symlinks and relative paths), and with
``force`` only an empty directory or a previous export (``EXPORT_FILES`` and nothing else); the
training-end export's ``owner`` run: only an export whose recorded source lies inside it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

from dflash_lab.export.weights import CHECKSUMS_FILE, CONFIG_FILE, MASK_FILE, WEIGHTS_FILE
from dflash_lab.writer_lock import pid_alive

REPORT_FILE = "EXPORT_REPORT.md"
#: every file an export writes; a previous export holds the first three and nothing but these
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE, MASK_FILE, CHECKSUMS_FILE)
#: EXPORT_REPORT.md header key of the resolved source path (read back for ``owner``)
SOURCE_PATH_KEY = "source path"
#: EXPORT_REPORT.md header key of the engines the export was made for (read by ``--inspect``)
ENGINES_KEY = "engines targeted"


def _spellings(path: Path) -> set[Path]:
    """The absolute path as written and with every symlink followed."""
    return {Path(os.path.abspath(path)), path.resolve()}


def _overlaps(out: Path, read: Path) -> bool:
    """True when ``out`` is ``read`` or one of its parents, in any spelling of either."""
    return any(o == r or o in r.parents for o in _spellings(out) for r in _spellings(read))


def report_value(out: Path, key: str) -> str | None:
    """The value of header line ``key`` in a previous export's report (None: no such line)."""
    try:
        lines = (out / REPORT_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    prefix = f"- {key}: "  # report.py writes header lines as "- key: value"
    return next((line[len(prefix):] for line in lines if line.startswith(prefix)), None)


def recorded_engines(out: Path) -> tuple[str, ...] | None:
    """The engines an export was made for (``--engine``, recorded in its report), or None for
    a directory without the record (another tool's, or an older export)."""
    found = report_value(out, ENGINES_KEY)
    return tuple(e.strip() for e in found.split(",") if e.strip()) if found else None


def _not_replaceable(out: Path, owner: Path | None) -> str | None:
    """Why ``out`` (which exists) must not be replaced, or None when it may be."""
    if not out.exists():
        return "it is a broken symlink"
    if not out.is_dir():
        return "it is a file, not a directory"
    entries = sorted(out.iterdir())
    if not entries:
        return None
    foreign = [e.name for e in entries if e.name not in EXPORT_FILES or not e.is_file()]
    if foreign:
        return f"it holds what an export does not write: {foreign[:5]}"
    if not all((out / name).is_file() for name in EXPORT_FILES[:3]):
        return f"it is not a complete export (needs {list(EXPORT_FILES[:3])})"
    if owner is None:
        return None
    found = report_value(out, SOURCE_PATH_KEY)  # the source path the export recorded
    source = Path(found) if found else None
    if source is None or not _overlaps(owner, source):
        return f"it is an export of {source or 'an unrecorded source'}, not of the run {owner}"
    return None


def refuse_overlap(out_dir: str | Path, reads: Iterable[str | Path], name: str = "OUT_DIR"
                   ) -> None:
    """ValueError when ``out_dir`` is one of ``reads`` or contains one (any spelling)."""
    out = Path(out_dir)
    for read in reads:
        if _overlaps(out, Path(read)):
            raise ValueError(
                f"{name} {out} would replace the export's own source {read} (it is that path or "
                f"contains it; resolved: {out.resolve()} and {Path(read).resolve()}); choose an "
                f"{name} outside the source")


def check_output_dir(out_dir: str | Path, reads: Iterable[str | Path], *, force: bool,
                     owner: str | Path | None = None, name: str = "OUT_DIR") -> None:
    """Refuse an ``out_dir`` whose replacement could delete anything the export did not write.
    ``reads``: SOURCE, run directory, checkpoint. ValueError when ``out_dir`` is or contains one;
    FileExistsError when it exists without ``force``, or is neither empty nor a previous export
    (of a source inside ``owner``, if given). ``name``: the setting's name in messages."""
    out = Path(out_dir)
    refuse_overlap(out, reads, name)
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    why = _not_replaceable(out, None if owner is None else Path(owner))
    if why:
        raise FileExistsError(
            f"{name} {out} exists and is not replaced: {why}. Replacing deletes it, so only an "
            "empty directory or a previous export (of this run, for the training-end export) is "
            f"replaced; choose another {name} or move {out} away yourself")


# ------------------------------------------------------------------ temporary directories
def stale_temp_dirs(out_dir: Path) -> list[Path]:
    """Temporary export directories beside ``out_dir`` (paths.temp_dir_prefix names them
    ``.OUT.tmp-<host>-<pid>-<random>``) left by a killed export on this host: the pid in the
    name is not running, and they hold only files an export writes."""
    host = socket.gethostname()
    found = []
    for path in out_dir.parent.glob(f".{out_dir.name}.tmp-{host}-*"):
        pid = path.name[len(f".{out_dir.name}.tmp-{host}-"):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink() and all(
                e.name in EXPORT_FILES and e.is_file() for e in path.iterdir()):
            found.append(path)
    return found


def publish_modes(directory: Path) -> None:
    """The modes other tools give a model directory: files 0644 and the directory 0755 under
    the usual umask 022, whatever wrote them (a shared model directory needs them readable)."""
    umask = os.umask(0)
    os.umask(umask)
    for entry in directory.iterdir():
        if entry.is_file():
            entry.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)
