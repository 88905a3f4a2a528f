"""The one write-then-rename helper (dflash_lab.paths.atomic_path / atomic_write_text)."""

from __future__ import annotations

import pytest

from dflash_lab.paths import atomic_path, atomic_write_text


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    atomic_write_text(path, "new ü")
    assert path.read_text(encoding="utf-8") == "new ü"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_an_error_while_writing_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("whole old file\n")
    with pytest.raises(OSError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise OSError("disk full")
    assert path.read_text() == "whole old file\n"
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]
