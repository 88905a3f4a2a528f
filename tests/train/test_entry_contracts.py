"""What dflash-train asks of its parts, declared on them (issue 28 item 4): the data module class
says whether it runs the target, what it takes from the drafter and how its config is checked;
the callbacks do the logger-specific work and record the target. A data module of another name
works without an edit to the entry code (tests/tools/test_no_sniffing.py keeps name sniffing
out)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dflash_lab.data.module import BlockDataModule, OfflineDataModule, OnlineDataModule
from dflash_lab.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE
from dflash_lab.train.callbacks import TARGET_KEY, RecordTarget, RunEndCallback, WandbRun
from dflash_lab.train.checks import check_data, data_class

DRAFTER = SimpleNamespace(target_layer_ids=(1, 3), hidden_size=64, vocab_size=768,
                          target_hidden_size=64)


class RenamedOnline(OnlineDataModule):
    """An online module whose name does not end in OnlineDataModule (the old sniff's miss)."""


class NotADataModule:
    pass


def test_each_data_module_declares_whether_it_runs_the_target():
    assert OnlineDataModule.runs_target and RenamedOnline.runs_target
    assert not OfflineDataModule.runs_target and not BlockDataModule.runs_target


def test_drafter_inputs_are_what_each_constructor_checks_against():
    # target_hidden_size: the per-layer feature width (a multi-stream target: docs/targets.md)
    assert OnlineDataModule.drafter_inputs(DRAFTER) == {"target_layer_ids": [1, 3],
                                                        "target_hidden_size": 64}
    assert OfflineDataModule.drafter_inputs(DRAFTER) == {
        "target_layer_ids": [1, 3], "hidden_size": 64, "target_hidden_size": 64,
        "vocab_size": 768}


def _capture(tmp_path, max_length):
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(
        {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "max_length": max_length}))
    return str(tmp_path)


def test_sequence_limits_come_from_each_data_kind(tmp_path):
    assert OnlineDataModule.sequence_limit(OmegaConf.create({"max_length": 64})) == (
        64, "data.max_length")
    limit, where = OfflineDataModule.sequence_limit(OmegaConf.create(
        {"path": _capture(tmp_path, 96)}))
    assert limit == 96 and "manifest.json max_length" in where
    assert BlockDataModule.sequence_limit(OmegaConf.create({})) == (None, "")


def test_offline_config_without_a_path_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="data.path is not set: data=offline"):
        OfflineDataModule.check_config(OmegaConf.create({"path": "???"}))
    OnlineDataModule.check_config(OmegaConf.create({}))  # nothing required


def _cfg(data, block_size=8):
    return OmegaConf.create({"data": data, "drafter": {"block_size": block_size}})


def test_a_data_module_of_another_name_is_checked_as_what_it_declares():
    """The old ``_target_.endswith("OnlineDataModule")`` took this one for a capture and read a
    manifest; the declared classmethods bound it by data.max_length."""
    target = f"{__name__}.RenamedOnline"
    assert data_class(OmegaConf.create({"_target_": target})) is RenamedOnline
    with pytest.raises(ValueError, match=r"block_size=80 .* \(data.max_length=64\)"):
        check_data(_cfg({"_target_": target, "max_length": 64}, block_size=80))
    check_data(_cfg({"_target_": target, "max_length": 64}))


@pytest.mark.parametrize(("target", "message"), [
    (f"{__name__}.NotADataModule", "is not a data module"),
    ("dflash_lab.data.module.NoSuchModule", "does not import"),
])
def test_a_data_target_that_is_no_data_module_is_refused_naming_it(target, message):
    with pytest.raises(ValueError, match=rf"data._target_='{target}' {message}"):
        data_class(OmegaConf.create({"_target_": target}))


def test_record_target_puts_the_identity_in_every_checkpoint():
    callback, checkpoint = RecordTarget({"weights_fingerprint": "abc"}), {}
    callback.on_save_checkpoint(None, None, checkpoint)
    assert checkpoint[TARGET_KEY] == {"weights_fingerprint": "abc"}


class _FakeRun:
    def __init__(self):
        self.artifacts, self.finished = [], 0

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self):
        self.finished += 1


@pytest.fixture
def wandb_logger(monkeypatch, tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    run = _FakeRun()
    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: run))
    return WandbLogger(save_dir=str(tmp_path), offline=True), run


def test_wandb_run_logs_the_export_as_an_artifact_then_finishes(wandb_logger, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger, run = wandb_logger
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    trainer = SimpleNamespace(is_global_zero=True,
                              loggers=[CSVLogger(str(tmp_path / "csv")), logger])
    callback = WandbRun(artifact_name="drafter-run1")
    assert isinstance(callback, RunEndCallback)  # train() calls on_run_end of these
    callback.on_run_end(trainer, {"export_dir": str(export)})
    assert [a.name for a in run.artifacts] == ["drafter-run1"] and run.finished == 1
    callback.on_run_end(trainer, {})  # no export: only finish
    assert len(run.artifacts) == 1 and run.finished == 2
    callback.on_run_end(SimpleNamespace(is_global_zero=False, loggers=[logger]),
                        {"export_dir": str(export)})
    assert len(run.artifacts) == 1 and run.finished == 2  # other ranks: nothing


def test_wandb_run_does_nothing_for_other_loggers(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger

    csv = CSVLogger(str(tmp_path))
    monkeypatch.setattr(CSVLogger, "log_metrics", lambda *a, **k: pytest.fail("logged"))
    WandbRun.finish(csv)
    WandbRun.log_images([csv, None], {"eval/plot": str(tmp_path / "p.png")})
    WandbRun.log_table(csv, key="t", columns=["a"], data=[[1]])
    WandbRun().on_run_end(SimpleNamespace(is_global_zero=True, loggers=[csv]),
                          {"export_dir": str(tmp_path)})


def test_the_default_callbacks_include_wandb_run(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_name=r7",
                                                      f"paths.output_dir={tmp_path}"])
    callback = instantiate(cfg.callbacks.wandb)
    assert isinstance(callback, WandbRun) and callback.artifact_name == "drafter-r7"
