"""Verified serving directories (export/weights.py): every export records the sha256 of its
files, and every reader (--inspect, dflash-eval's loader, warm start, re-export) refuses a
directory whose files differ, naming the file, unless verification is turned off; a directory
without the record is read and says it was not verified."""

import shutil
import subprocess

import pytest

from dflash_lab.eval.loading import load_drafter
from dflash_lab.export import export_drafter, import_drafter, inspect_dir, load_source
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, main
from dflash_lab.export.weights import CHECKSUMS_FILE, WEIGHTS_FILE, Source, verify_dir
from tests.export_doubles import make_config, random_state


@pytest.fixture
def export_dir(tmp_path):
    config = make_config("zlab_default")
    out = tmp_path / "export"
    export_drafter(Source(config, random_state(config), "checkpoint", "test"), out,
                   engine="vllm", dtype="float32")
    return out


def _flip(path, count: int = 64):
    """Flip ``count`` bytes in the middle of ``path`` (the size stays)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + count] = bytes(b ^ 0xFF for b in data[mid:mid + count])
    path.write_bytes(bytes(data))


def test_an_export_records_the_sha256_of_every_file_it_writes(export_dir):
    listed = (export_dir / CHECKSUMS_FILE).read_text().splitlines()
    names = sorted(line.split("  ", 1)[1] for line in listed)
    assert names == sorted(p.name for p in export_dir.iterdir() if p.name != CHECKSUMS_FILE)
    done = subprocess.run(["sha256sum", "-c", CHECKSUMS_FILE], cwd=export_dir,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr  # the standard tool agrees
    assert verify_dir(export_dir).status == "verified"
    assert "SHA256SUMS verified (3 files)" in load_source(export_dir).notes


def test_flipped_bytes_are_refused_by_every_reader_naming_the_file(export_dir, tmp_path,
                                                                   capsys):
    _flip(export_dir / WEIGHTS_FILE)
    want = f"{WEIGHTS_FILE} differs from its recorded sha256"
    for read in (lambda: load_source(export_dir), lambda: import_drafter(export_dir),
                 lambda: load_drafter(export_dir),
                 lambda: load_drafter(export_dir, assume="vllm-main-v2"),
                 lambda: export_drafter(export_dir, tmp_path / "again", engine="vllm")):
        with pytest.raises(ValueError, match=want) as err:
            read()
        assert "--no-verify" in str(err.value) and "verify_checksums=false" in str(err.value)
    assert not (tmp_path / "again").exists()
    result = inspect_dir(export_dir)
    assert not result.ok and any(want in p for p in result.problems)
    assert main(["--inspect", str(export_dir)]) == EXIT_REFUSED
    assert want in capsys.readouterr().out


def test_verification_can_be_turned_off_for_a_hand_edited_directory(export_dir, tmp_path):
    config = (export_dir / "config.json").read_text()
    (export_dir / "config.json").write_text(config.replace('"rms_norm_eps"', '"rms_norm_eps"', 1)
                                            + "\n")  # edited on purpose (same meaning)
    with pytest.raises(ValueError, match="config.json differs"):
        load_source(export_dir)
    source = load_source(export_dir, verify=False)
    assert "SHA256SUMS not checked (verification turned off)" in source.notes
    assert load_drafter(export_dir, verify_checksums=False).drafter is not None
    assert inspect_dir(export_dir, verify=False).ok
    assert main(["--inspect", str(export_dir), "--no-verify"]) == EXIT_OK
    assert main([str(export_dir), str(tmp_path / "again"), "--engine", "vllm",
                 "--dtype", "float32", "--no-verify"]) == EXIT_OK
    assert verify_dir(tmp_path / "again").status == "verified"  # the re-export records anew


def test_a_directory_without_the_record_is_read_and_says_so(export_dir):
    (export_dir / CHECKSUMS_FILE).unlink()
    note = "no SHA256SUMS (not written by dflash-export, or by an older one): files not verified"
    assert note in load_source(export_dir).notes
    assert note in load_drafter(export_dir).notes
    result = inspect_dir(export_dir)
    assert result.ok and f"files: {note}" in result.text


def test_a_file_added_beside_the_export_is_named_not_refused(export_dir):
    (export_dir / "README.md").write_text("model card\n")
    check = verify_dir(export_dir)
    assert check.status == "verified" and check.extra == ("README.md",)
    assert "not in the record, not checked: README.md" in check.note


def test_a_missing_or_malformed_record_line_is_a_problem(export_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(export_dir, copy)
    (copy / "EXPORT_REPORT.md").unlink()
    assert verify_dir(copy).problems == ["EXPORT_REPORT.md is missing"]
    (export_dir / CHECKSUMS_FILE).write_text("not a checksum line\n")
    problems = verify_dir(export_dir).problems
    assert len(problems) == 1 and "line 1: expected '<sha256>  <file name>'" in problems[0]


def test_warm_start_verifies_an_export(tiny_target, tmp_path):
    from tests.train.test_warm_start import tiny_source_config, warm, write_checkpoint

    config = tiny_source_config(tiny_target)
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", config,
                            random_state(config))
    out = tmp_path / "export"
    export_drafter(ckpt, out, engine="vllm", dtype="float32")
    _flip(out / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE} differs.*drafter.verify_checksums="):
        warm(tiny_target, out)
    assert warm(tiny_target, out, verify_checksums=False) is not None
