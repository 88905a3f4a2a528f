"""Checksum sidecars of checkpoint files: ``<file>.sha256`` in ``sha256sum`` format, written with
every checkpoint (:mod:`dflash_lab.train.callbacks`) and checked at resume and by the exporter,
so flipped bytes in a ``.ckpt`` are an error naming the file, not a silently different drafter.
:func:`sha256_json` seals a JSON record with a checksum of itself (capture manifests). Standard
library only (the exporter runs in serving environments).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of the file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(record: dict, without: str = "") -> str:
    """Hex sha256 of ``record`` (minus its key ``without``: the checksum's own) as canonical JSON
    (sorted keys, no spaces): the same however the file is indented."""
    body = {k: v for k, v in record.items() if k != without}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def sha256_of(data) -> str:
    """Hex sha256 of ``data`` as JSON with sorted keys (anything else as its str)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def sidecar_text(digest: str, path: Path) -> str:
    return f"{digest}  {path.name}\n"


def checksum_problem(path: Path) -> str | None:
    """Why ``path`` does not match its sidecar; None if it does or has none (old, others' files)."""
    side = sidecar(Path(path))
    if not side.is_file():
        return None
    want = side.read_text().split(maxsplit=1)[0] if side.read_text().strip() else ""
    have = sha256_file(Path(path))
    if have != want:
        return (f"sha256 {have[:16]}... does not match {side.name} ({want[:16]}...): the file "
                "is truncated or corrupt")
    return None
