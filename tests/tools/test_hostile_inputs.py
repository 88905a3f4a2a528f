"""Hostile inputs at the entry points (issue 47): each is one ``error:`` line naming the value,
the file and the fix, exit 2, no traceback, and leaves nothing behind that was not there."""

import json

import pytest

from dflash_lab.commands import export


@pytest.mark.parametrize("content", [{"a": 1}, [], "x"])
def test_inspect_of_a_config_that_is_no_drafter_config_is_one_line(tmp_path, capsys, content):
    (tmp_path / "config.json").write_text(json.dumps(content))
    assert export(["--inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    assert f"{tmp_path / 'config.json'} is not a drafter config" in err
    assert "num_hidden_layers" in err  # what a drafter config needs


# ------------------------------------------------- an output location that cannot be written
# Tests run as root, where chmod 0o555 does not stop a write: a path under a regular file
# (ENOTDIR) fails for root too, and a patched lock file creation stands in for EACCES / EROFS.
COMMANDS = [
    ("dflash_lab.train.run:train", "paths.output_dir"),
    ("dflash_lab.capture:capture", "capture.out_dir"),
    ("dflash_lab.eval.cli:evaluate", "output_dir"),
    ("dflash_lab.regenerate:regenerate", "regenerate.settings.out_dir"),
]


def _run_command(entry: str, key: str, out, capsys) -> str:
    """Run the command's body on a config holding only its output directory (the lock comes
    first: tests/tools/test_writer_lock.py), as its entry point does; its stderr."""
    import importlib

    from omegaconf import OmegaConf

    from dflash_lab.errors import USER_ERROR_EXIT, user_errors

    module, name = entry.split(":")
    cfg = OmegaConf.create()
    OmegaConf.update(cfg, key, str(out), force_add=True)
    with pytest.raises(SystemExit) as done, user_errors():
        getattr(importlib.import_module(module), name)(cfg)
    assert done.value.code == USER_ERROR_EXIT
    return capsys.readouterr().err


def _permission_denied(monkeypatch):
    import errno

    from dflash_lab import writer_lock

    def denied(path, record):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(writer_lock, "_create", denied)


@pytest.mark.parametrize(("entry", "key"), COMMANDS)
@pytest.mark.parametrize("fault", ["under a file", "permission denied"])
def test_an_output_location_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch,
                                                               entry, key, fault):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    (tmp_path / "file.txt").write_text("a file, not a folder")
    out = tmp_path / "file.txt" / "sub" if fault == "under a file" else tmp_path / "new" / "run"
    if fault == "permission denied":
        _permission_denied(monkeypatch)
    err = _run_command(entry, key, out, capsys)
    assert err.startswith(f"error: {key}={out} cannot be written: ")
    assert "choose a" in err and err.count("error:") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # no folder left behind


def _exportable(tmp_path):
    from tests.export_doubles import make_config, random_state, write_checkpoint

    config = make_config("zlab_default")
    return write_checkpoint(tmp_path / "src" / "last.ckpt", config, random_state(config))


@pytest.mark.parametrize("fault", ["under a file", "permission denied"])
def test_an_export_out_dir_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch,
                                                              fault):
    ckpt = _exportable(tmp_path)
    (tmp_path / "file.txt").write_text("a file, not a folder")
    out = tmp_path / "file.txt" / "sub" if fault == "under a file" else tmp_path / "new" / "out"
    if fault == "permission denied":
        _permission_denied(monkeypatch)
    assert export([str(ckpt), str(out), "--engine", "vllm", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-export: error: OUT_DIR={out} cannot be written: ")
    assert err.count("error:") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "src"]


# --------------------------------------------------------------------------- a full disk
def test_a_full_disk_during_an_export_is_named_and_keeps_out_dir(tmp_path, capsys,
                                                                 monkeypatch):
    from safetensors import SafetensorError

    import dflash_lab.export.weights as weights

    def disk_full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                              'StorageFull, message: "No space left on device" })')

    ckpt = _exportable(tmp_path)
    monkeypatch.setattr(weights, "save_file", disk_full)
    assert export([str(ckpt), str(tmp_path / "out"), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-export: error: disk full: ")
    assert "kept: OUT_DIR as it was" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temp dir, no lock
    monkeypatch.undo()
    assert export([str(ckpt), str(tmp_path / "out"), "--engine", "vllm"]) == 0


# ------------------------------------------------------------- unknown keys in a config group
def _compose(config: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config, overrides=overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["data=offline", "data.path=CAP"],  # the recipe's online-data keys under data=offline
     r"data.demo_rows: data \(dflash_lab.data.module.OfflineDataModule\) takes no key "
     r"'demo_rows' \(nor \['max_length'\]\)"),
    (["+data.limt=64"], "data.limt: .* did you mean data.limit\\?"),
    (["+trainer.max_epoch=3"], "trainer.max_epochs\\?"),
    (["+module.optimizer.learning_rate=0.1"], "module.optimizer.learning_rate: .*'lr'"),
    (["+callbacks.checkpoint.save_lst=true"], "did you mean callbacks.checkpoint.save_last\\?"),
    (["+drafter.selector_rnak=8"], "did you mean drafter.selector_rank\\?"),  # DrafterConfig's
])
def test_an_unknown_key_in_any_group_is_refused_before_anything_is_built(
        tmp_path, monkeypatch, overrides, message):
    import dflash_lab.targets.loader as loader
    from dflash_lab.train.run import train

    monkeypatch.setattr(loader, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    cfg = _compose("train", ["recipe=tiny_cpu", "logger=none", *overrides,
                             f"paths.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert list(tmp_path.iterdir()) == []


def _every_option() -> list[tuple[str, list[str]]]:
    """Every shipped command config, recipe and group option, as composed."""
    from dflash_lab.paths import CONF_DIR

    cases = [(name, []) for name in ("train", "capture", "eval", "regenerate")]
    options = {"recipe": "recipe", "data": "data", "drafter": "drafter", "module": "module",
               "module/optimizer": "module/optimizer", "trainer": "trainer",
               "logger": "logger", "target": "target", "eval_data@data": "eval_data"}
    for group, folder in options.items():
        config = "eval" if folder == "eval_data" else "train"
        cases += [(config, [f"{group}={o.stem}"])
                  for o in sorted((CONF_DIR / folder).glob("*.yaml"))]
    return cases


def test_every_shipped_config_passes_the_key_check():
    """The check refuses nothing a shipped recipe or group option sets (and so cannot be a
    hand list that went stale): each composes and passes."""
    from dflash_lab.entry import check_group_keys

    for config, overrides in _every_option():
        check_group_keys(_compose(config, overrides))


# ------------------------------------------------------------------------------ smaller cases
def test_a_drafter_path_to_a_run_config_yaml_names_the_run_directory(tmp_path):
    from dflash_lab.eval.loading import load_drafter

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ValueError, match="is a file but not a checkpoint") as err:
        load_drafter(run / "config.yaml")
    assert f"the run directory {run}" in str(err.value) and "weights_only" not in str(err.value)


def test_a_data_path_that_is_a_directory_says_so(tmp_path):
    from dflash_lab.data.conversations import load_conversations
    from dflash_lab.eval.prompts import load_rows

    with pytest.raises(ValueError, match="is a directory; pass one .jsonl/.json/.parquet file"):
        load_conversations(str(tmp_path))
    with pytest.raises(ValueError, match=r"data.path=.* is a directory; pass a .jsonl"):
        load_rows(str(tmp_path))


def test_a_bad_recipe_exits_2_in_dflash_train(capsys, monkeypatch):
    from dflash_lab.train import cli

    monkeypatch.setattr("sys.argv", ["dflash-train", "recipe=tiny_cpy"])
    monkeypatch.setattr(cli, "_hydra_main", lambda: pytest.fail("composed"))
    with pytest.raises(SystemExit) as done:
        cli.main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: recipe=tiny_cpy: there is no ")
    assert "did you mean recipe=tiny_cpu?" in err and err.count("\n") == 2  # + the debug hint


def test_a_bad_recipe_is_one_line_in_dflash_lab_too(capsys):
    from dflash_lab.pipeline import main

    assert main(["run", "recipe=tiny_cpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-lab: error: recipe=tiny_cpy: there is no ")
    assert "did you mean recipe=tiny_cpu?" in err and err.count("\n") == 1


def test_a_refused_dflash_eval_leaves_no_output_folder(tmp_path):
    """Hydra made ``output_dir`` (its run dir) before any check: a refusal left it empty."""
    import os
    import subprocess
    import sys

    from dflash_lab.paths import REPO_ROOT

    out = tmp_path / "eval"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DFLASH_DEBUG")}
    done = subprocess.run([sys.executable, "-c", "from dflash_lab.commands import evaluate; "
                           "evaluate()", "mode=nonsense", f"output_dir={out}", "logger=none"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: mode='nonsense'" in done.stderr and not out.exists()
