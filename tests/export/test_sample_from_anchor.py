"""sample_from_anchor in config.json: written explicitly, how each engine rule set runs it,
the export's refusal, --inspect's warning, and a tiny training run that exports, inspects and
decodes losslessly with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_lab.export.api import ExportRefused, export_drafter, inspect_dir, plan_export
from dflash_lab.export.checks import refusals
from dflash_lab.export.engines import Artifacts
from dflash_lab.export.formats import read_all
from tests.export_doubles import make_config

V2_RULE_SETS = ("vllm-main-v2", "vllm<=0.26-v2")


def test_the_engines_run_a_declared_false_as_trained():
    readings = read_all(make_config("zlab_default").to_dict(), Artifacts())
    assert all(r.loads and "sample_from_anchor" not in r.overrides for r in readings.values())


def test_vllm_v2_refuses_true_and_the_others_drop_it():
    d = make_config("zlab_default", sample_from_anchor=True).to_dict()
    assert d["dflash_config"]["sample_from_anchor"] is True
    readings = read_all(d, Artifacts())
    for name, reading in readings.items():
        if name in V2_RULE_SETS:  # v1/worker/gpu/spec_decode/dflash/speculator.py
            assert not reading.loads and "sample_from_anchor=True" in reading.refusal
        else:  # V1 runner and SGLang never read the key: they draft slots 1..B-1
            assert reading.overrides["sample_from_anchor"] is False
            assert any("sample_from_anchor=true" in item for item in reading.dropped)


def test_a_third_party_config_is_read_with_its_key():
    from dflash_lab.export.engines.zlab import base_config
    from tests.export_doubles import zlab_config

    d = zlab_config("qwen3_8b")
    assert not base_config(d, "z-lab").sample_from_anchor
    d["dflash_config"]["sample_from_anchor"] = True
    assert base_config(d, "z-lab").sample_from_anchor


def test_the_export_plan_refuses_true_unless_lossy_is_allowed():
    config = make_config("zlab_default", sample_from_anchor=True)
    for engine in ("vllm", "sglang"):
        _, findings = plan_export(config, (engine,))
        assert any("sample_from_anchor" in f.message for f in refusals(findings)), engine
    _, findings = plan_export(config, ("vllm",), allow_lossy=True)
    assert refusals(findings) == []


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash_lab.paths import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.slow
def test_a_tiny_anchor_run_exports_inspects_and_decodes_losslessly(tiny_target, tiny_target_dir,
                                                                   tmp_path):
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
    from dflash_lab.eval.prompts import encode_prompt
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.eval.target_runner import TargetRunner
    from dflash_lab.targets.demo_corpus import demo_conversations
    from dflash_lab.train.run import train

    run = train(_compose([
        "recipe=tiny_cpu", f"paths.output_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}",
        "data.demo_rows=16", f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=96",
        "data.batch_size=8", "data.val_fraction=0.25", "logger=none", "trainer.max_steps=3",
        "trainer.max_epochs=3", "drafter.sample_from_anchor=true", "export.enabled=true",
        "export.allow_lossy=true", "export.dtype=float32"]))
    out = Path(run["export_dir"])
    assert json.loads((out / "config.json").read_text())["dflash_config"]["sample_from_anchor"]
    report = inspect_dir(out)
    assert any("sample_from_anchor=true" in p for p in report.problems)
    assert "sample_from_anchor: true" in report.text
    with pytest.raises(ExportRefused, match="sample_from_anchor"):
        export_drafter(out, tmp_path / "again", engine="sglang", dtype="float32")
    loaded = load_drafter(out)  # dflash-eval drafter.path=
    assert loaded.drafter.config.sample_from_anchor
    pieces = tiny_target.pieces()
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    settings = DecodeSettings(max_new_tokens=20)
    for conv in demo_conversations(2, seed=7):
        prompt = encode_prompt(tiny_target.tokenizer, conv[:1])
        spec = speculative_generate(
            TargetRunner(tiny_target.model, loaded.drafter.config.target_layer_ids), proposer,
            prompt, settings)
        assert spec.output_ids == baseline_generate(TargetRunner(tiny_target.model), prompt,
                                                    settings).output_ids
