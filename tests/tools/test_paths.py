"""The one write-then-rename protocol (dflash_lab.paths): files (atomic_path /
atomic_write_text) and directories (atomic_dir)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dflash_lab.paths import atomic_dir, atomic_path, atomic_write_text, temp_dir_prefix


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


# ------------------------------------------------------------------ atomic_path: checkpoints
def test_a_shared_temporary_name_and_another_last_step(tmp_path):
    """``temp`` (one name for every rank of a sharded save) and ``finish`` (the checkpoint's
    fsync, checksum and rotation) replace the defaults; finish gets (temporary, path)."""
    path, shared = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp"
    calls = []

    def finish(tmp, dest):
        calls.append((tmp, dest))
        tmp.rename(dest)

    with atomic_path(path, temp=shared, finish=finish) as tmp:
        assert tmp == shared
        tmp.write_text("weights")
    assert calls == [(shared, path)] and path.read_text() == "weights"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_failing_last_step_removes_the_temporary_file_but_keeps_a_directory(tmp_path):
    def full_disk(tmp, dest):
        raise OSError("no space left")

    path = tmp_path / "last.ckpt"
    with pytest.raises(OSError, match="no space"), atomic_path(path, finish=full_disk) as tmp:
        tmp.write_text("whole")
    assert list(tmp_path.iterdir()) == []
    shared = tmp_path / ".last.ckpt.tmp"  # a sharded checkpoint: other ranks may still write it
    with pytest.raises(OSError, match="no space"), atomic_path(path, temp=shared,
                                                               finish=full_disk) as tmp:
        (tmp / "rank0").mkdir(parents=True)
    assert shared.is_dir() and not path.exists()


# ------------------------------------------------------------------------- atomic_dir
def _build(tmp: Path, text: str) -> None:
    (tmp / "config.json").write_text(text)
    (tmp / "model.safetensors").write_text(text * 3)


def test_a_directory_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "sub" / "target"
    with atomic_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.is_dir() and list(tmp.iterdir()) == []
        _build(tmp, "new")
        assert not out.exists()  # nothing where the target goes until the build is done
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["target"]  # no temporary left


def test_a_failure_while_building_leaves_nothing_and_the_old_directory_whole(tmp_path):
    out = tmp_path / "target"
    with pytest.raises(RuntimeError, match="killed"), atomic_dir(out) as tmp:
        _build(tmp, "half")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    _build(out, "old")
    with pytest.raises(RuntimeError, match="killed"), atomic_dir(out) as tmp:
        _build(tmp, "half")
        raise RuntimeError("killed mid-write")
    assert (out / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_an_existing_directory_is_replaced_kept_or_refused_as_the_caller_says(tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    _build(out, "old")
    (out / "stale.bin").write_text("from the old recipe")
    with atomic_dir(out) as tmp:  # default: replaced, nothing of the old one stays
        _build(tmp, "new")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "new"
    with atomic_dir(out, replace_existing=lambda old: False) as tmp:  # an equal one is there
        _build(tmp, "other")
    assert (out / "config.json").read_text() == "new"

    def refuse(old):
        raise FileExistsError(f"{old} exists; pass --force to replace it")

    with pytest.raises(FileExistsError, match="--force"), atomic_dir(out, refuse) as tmp:
        _build(tmp, "other")
    assert (out / "config.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no temporary, no .old- left


def test_a_directory_another_builder_renamed_in_first_is_decided_again(tmp_path):
    """The other builder finishes between our check and our rename: ``replace_existing`` sees
    its directory, and keeping it leaves its result whole."""
    out = tmp_path / "target"
    seen = []
    with atomic_dir(out, replace_existing=lambda old: seen.append(old) or False) as tmp:
        _build(tmp, "ours")
        out.mkdir()  # the other builder, just before our rename
        _build(out, "theirs")
    assert seen == [out] and (out / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_concurrent_builders_agree_on_one_whole_directory(tmp_path):
    """Four builders of the same directory at once (as ranks building one tiny target): each
    keeps an equal result already there, so one complete directory stays and no temporary."""
    out = tmp_path / "target"
    start = threading.Barrier(4)
    errors = []

    def builder(i):
        try:
            with atomic_dir(out, replace_existing=lambda old: not (old / "done").is_file()) as tmp:
                start.wait()
                _build(tmp, "same")
                (tmp / "done").write_text(str(i))
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=builder, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "done",
                                                      "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_a_rename_that_fails_for_another_reason_puts_the_old_directory_back(tmp_path,
                                                                            monkeypatch):
    import dflash_lab.paths as paths

    out = tmp_path / "target"
    out.mkdir()
    _build(out, "old")
    real = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".target.tmp-"):
            raise PermissionError(13, "Permission denied", str(dst))
        real(src, dst)

    monkeypatch.setattr(paths.os, "rename", rename)
    with pytest.raises(PermissionError), atomic_dir(out) as tmp:
        _build(tmp, "new")
    assert (out / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_the_build_directory_gets_the_mode_of_a_plain_mkdir(tmp_path):
    """Not mkdtemp's 0700: a shared target or model directory must be readable by others."""
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "target") as tmp:
            assert tmp.name.startswith(temp_dir_prefix(tmp_path / "target"))
    finally:
        os.umask(old)
    assert oct((tmp_path / "target").stat().st_mode & 0o777) == "0o755"
