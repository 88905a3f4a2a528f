"""An export never deletes what it did not write (issue 16, items 1 and 2).

``dflash-export SRC OUT --force`` and the training-end export (``export.enabled=true``) replace
OUT by deleting it: OUT must not be or contain the source, and only an empty directory or a
previous export (of this run, for training) is replaced. Each case keeps the data it would lose.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dflash_lab.export import export_drafter
from dflash_lab.export.cli import EXIT_OK, EXIT_USAGE, main
from dflash_lab.export.outdir import REPORT_FILE, SOURCE_PATH_KEY, report_value
from dflash_lab.paths import CONF_DIR
from tests.export_doubles import make_config, random_state, write_checkpoint


def make_run(path: Path, seed: int = 0) -> Path:
    """A training run directory as the exporter reads it: ``checkpoints/last.ckpt``."""
    config = make_config("zlab_default")
    write_checkpoint(path / "checkpoints" / "last.ckpt", config, random_state(config, seed))
    (path / "config.yaml").write_text("run: record\n")
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def runs(tmp_path):
    """``runs/a`` (the source) beside ``runs/b`` (a sibling that must survive)."""
    make_run(tmp_path / "runs" / "b", seed=1)
    return make_run(tmp_path / "runs" / "a")


def _export(src, out, **kw):
    return export_drafter(src, out, engine="vllm", dtype="float32", **kw)


# ---------------------------------------------------------------------------- OUT vs SOURCE
@pytest.mark.parametrize("which", ["run", "parent", "checkpoints", "grandparent"])
def test_force_never_replaces_the_source_or_a_parent(runs, which):
    out = {"run": runs, "parent": runs.parent, "checkpoints": runs / "checkpoints",
           "grandparent": runs.parent.parent}[which]
    before = snapshot(runs.parent)
    with pytest.raises(ValueError, match="own source") as err:
        _export(runs, out, force=True)
    assert str(out) in str(err.value) and str(runs) in str(err.value)
    assert snapshot(runs.parent) == before


def test_relative_paths_are_resolved(runs, monkeypatch):
    monkeypatch.chdir(runs)
    before = snapshot(runs.parent)
    with pytest.raises(ValueError, match="own source"):
        _export(".", "..", force=True)
    with pytest.raises(ValueError, match="own source"):
        _export("../a/./", "../../runs/", force=True)
    assert snapshot(runs.parent) == before


def test_symlinks_are_followed_both_ways(runs, tmp_path):
    before = snapshot(runs.parent)
    (tmp_path / "out_link").symlink_to(runs.parent, target_is_directory=True)
    with pytest.raises(ValueError, match="own source"):
        _export(runs, tmp_path / "out_link", force=True)
    (tmp_path / "src_link").symlink_to(runs, target_is_directory=True)
    with pytest.raises(ValueError, match="own source"):
        _export(tmp_path / "src_link", runs.parent, force=True)
    assert snapshot(runs.parent) == before


def test_the_checkpoint_a_run_points_to_is_protected_too(tmp_path):
    """best.json may name a checkpoint outside the run: OUT holding it is refused as well."""
    elsewhere = make_run(tmp_path / "store")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = elsewhere / "checkpoints" / "last.ckpt"
    (run / "checkpoints" / "best.json").write_text(f'{{"path": "{ckpt}", "val/tau": 2.0}}')
    before = snapshot(elsewhere)
    with pytest.raises(ValueError, match="own source") as err:
        _export(run, elsewhere, force=True)
    assert str(ckpt) in str(err.value)
    assert snapshot(elsewhere) == before


def test_a_serving_dir_is_not_exported_onto_itself(runs, tmp_path):
    _export(runs, tmp_path / "exp")
    before = snapshot(tmp_path / "exp")
    with pytest.raises(ValueError, match="own source"):
        _export(tmp_path / "exp", tmp_path / "exp", force=True)
    assert snapshot(tmp_path / "exp") == before


# ---------------------------------------------------------------------------- what --force replaces
def test_force_replaces_only_an_empty_dir_or_a_previous_export(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    _export(runs, tmp_path / "empty", force=True)
    assert (tmp_path / "empty" / "config.json").is_file()
    first = (tmp_path / "empty" / REPORT_FILE).read_text()
    _export(runs.parent / "b", tmp_path / "empty", force=True)  # a previous export: replaced
    assert (tmp_path / "empty" / REPORT_FILE).read_text() != first


@pytest.mark.parametrize("kind", ["other_files", "export_plus_extra", "file", "partial"])
def test_force_refuses_anything_else(runs, tmp_path, kind):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("notes")
    elif kind == "partial":
        out.mkdir()
        (out / "config.json").write_text("{}")  # a third-party dir, not our export
    else:
        if kind == "export_plus_extra":
            _export(runs, out)
        out.mkdir(exist_ok=True)
        (out / "keep.txt").write_text("mine")
    before = snapshot(tmp_path / "out") if out.is_dir() else out.read_bytes()
    with pytest.raises(FileExistsError, match="not replaced"):
        _export(runs, out, force=True)
    assert (snapshot(out) if out.is_dir() else out.read_bytes()) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_refusals_name_both_paths_and_exit_2(runs, tmp_path, capsys):
    assert main([str(runs), str(runs.parent), "--force"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(runs) in err and str(runs.parent) in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    assert main([str(runs), str(tmp_path / "mine"), "--force"]) == EXIT_USAGE
    assert (tmp_path / "mine" / "thesis.tex").is_file()
    assert main([str(runs), str(tmp_path / "exp"), "--dtype", "float32"]) == EXIT_OK
    assert main([str(runs), str(tmp_path / "exp"), "--force", "--no-self_check"]) == EXIT_OK
    assert report_value(tmp_path / "exp", SOURCE_PATH_KEY) == str(runs.resolve())


# ---------------------------------------------------------------------------- training-end export
def test_owner_replaces_only_its_own_export(runs, tmp_path):
    out, other = tmp_path / "exp", runs.parent / "b"
    _export(runs, out, force=True, owner=runs)
    _export(runs, out, force=True, owner=runs)  # the same run again (rerun, resume): replaced
    before = snapshot(out)
    with pytest.raises(FileExistsError, match="not of the run"):
        _export(other, out, force=True, owner=other)
    assert snapshot(out) == before


def _train_cfg(run: Path, out: Path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "recipe=tiny_cpu", f"paths.output_dir={run}", "export.enabled=true",
            f"export.out_dir={out}", "logger=none"])


@pytest.mark.parametrize("where", ["parent", "run", "other_export", "foreign"])
def test_train_refuses_a_bad_export_out_dir_before_training(runs, tmp_path, monkeypatch,
                                                            where):
    import dflash_lab.train.run as run_mod

    new_run = runs.parent / "new"
    out = {"parent": runs.parent, "run": new_run, "other_export": tmp_path / "exp",
           "foreign": runs}[where]
    if where == "other_export":
        _export(runs, out)  # an export of run a; the new run must not replace it
    (runs.parent / "new").mkdir()
    before = snapshot(tmp_path)

    def no_training(cfg):
        raise AssertionError("training started before export.out_dir was checked")

    monkeypatch.setattr(run_mod, "build_components", no_training)
    with pytest.raises((ValueError, FileExistsError), match="export.out_dir"):
        run_mod.train(_train_cfg(new_run, out))
    assert snapshot(tmp_path) == before  # not even run_info.json was written


def test_training_end_export_replaces_its_previous_export(runs):
    from dflash_lab.train.run import export_run

    cfg = OmegaConf.create({"export": {"out_dir": str(runs / "export"), "engine": "vllm",
                                       "dtype": "float32"}, "run_name": "t"})
    assert Path(export_run(cfg, runs)).is_dir()
    os.utime(runs / "export" / "config.json", (0, 0))
    export_run(cfg, runs)  # resume of the same run: its own export is replaced
    assert (runs / "export" / "config.json").stat().st_mtime > 0
    cfg.export.out_dir = str(runs.parent)
    with pytest.raises(ValueError, match="own source"):
        export_run(cfg, runs)
    assert (runs.parent / "b" / "checkpoints" / "last.ckpt").is_file()
