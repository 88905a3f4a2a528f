"""Verified serving directories: ``SHA256SUMS`` (``sha256sum`` format) over every file an export
writes, written last, and its check by every reader of a serving directory; a directory without
it is read and reported not verified, and :data:`OVERRIDES` turn the check off (docs/export.md,
"What is written"; docs/guarantees.md, "Damaged files").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_lab.checksums import sha256_file

CHECKSUMS_FILE = "SHA256SUMS"
#: How each reader turns verification off (named in every refusal).
OVERRIDES = ("dflash-export --no-verify", "dflash-eval drafter.verify_checksums=false",
             "dflash-train drafter.verify_checksums=false")


def write_checksums(directory: Path) -> Path:
    """Write ``SHA256SUMS`` over every other regular file of ``directory`` (sorted by name)."""
    directory = Path(directory)
    lines = [f"{sha256_file(p)}  {p.name}\n" for p in sorted(directory.iterdir())
             if p.is_file() and p.name != CHECKSUMS_FILE]
    path = directory / CHECKSUMS_FILE
    path.write_text("".join(lines), encoding="utf-8")
    return path


@dataclass
class Verification:
    """``status``: ``verified`` | ``unrecorded`` (no SHA256SUMS) | ``failed`` | ``skipped``;
    ``problems``: each file that differs, is missing, or is not listed, by name."""

    status: str
    problems: list[str]
    files: int = 0
    extra: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """One line for a reader's notes."""
        added = (f"; not in the record, not checked: {', '.join(self.extra)}" if self.extra
                 else "")
        return {"verified": f"{CHECKSUMS_FILE} verified ({self.files} files{added})",
                "unrecorded": f"no {CHECKSUMS_FILE} (not written by dflash-export, or by an "
                              "older one): files not verified",
                "skipped": f"{CHECKSUMS_FILE} not checked (verification turned off)",
                }.get(self.status, f"{CHECKSUMS_FILE} check failed: " + "; ".join(self.problems))


def _listed(path: Path) -> dict[str, str]:
    """{file name: hex digest} of a SHA256SUMS file; ValueError naming a malformed line."""
    listed = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            raise ValueError(f"{path}, line {number}: expected '<sha256>  <file name>', got "
                             f"{line[:80]!r}")
        listed[name.lstrip("*")] = digest.lower()
    return listed


def verify_dir(directory: Path, absent_ok: tuple[str, ...] = ()) -> Verification:
    """Check ``directory`` against its ``SHA256SUMS``: every listed file must exist with that
    digest (``absent_ok``: listed files that may be missing, e.g. the weights when only
    config.json is inspected). Files added beside them (a README for a model hub) are not what
    an engine loads from an export; they are named in ``extra``, not refused."""
    directory = Path(directory)
    record = directory / CHECKSUMS_FILE
    if not record.is_file():
        return Verification("unrecorded", [])
    try:
        listed = _listed(record)
    except ValueError as err:
        return Verification("failed", [str(err)])
    problems = []
    for name, want in listed.items():
        path = directory / name
        if not path.is_file():
            if name not in absent_ok:
                problems.append(f"{name} is missing")
        elif sha256_file(path) != want:
            problems.append(f"{name} differs from its recorded sha256 (changed or damaged "
                            "after the export)")
    extra = tuple(sorted(p.name for p in directory.iterdir()
                         if p.is_file() and p.name != CHECKSUMS_FILE and p.name not in listed))
    return Verification("failed" if problems else "verified", problems, len(listed), extra)


def checked(directory: Path, verify: bool = True) -> Verification:
    """:func:`verify_dir`, or ``skipped`` when ``verify`` is off; ValueError naming each file
    that differs (and how to read a hand-edited directory anyway) when the check fails."""
    if not verify:
        return Verification("skipped", [])
    result = verify_dir(directory)
    if result.status == "failed":
        raise ValueError(f"serving directory {directory}: " + "; ".join(result.problems)
                         + f". Re-export it from its checkpoint, or, for a directory you edited "
                         f"on purpose, turn the check off ({', '.join(OVERRIDES)})")
    return result
