"""DrafterConfig: resolution, serving round trip, third-party configs, validation errors."""

import json

import pytest

from dflash_lab.model.config import (
    TRAINING_SPEC_KEY,
    DrafterConfig,
    LayerSpec,
    build_target_layer_ids,
)
from dflash_lab.testing import LAYOUTS, tiny_drafter_config

ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
    "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize(("n_layers", "n", "expected"), [
    (36, 5, [1, 9, 17, 25, 33]), (36, 1, [18]), (28, 5, [1, 7, 13, 19, 25]), (30, 3, [1, 14, 27]),
    # ties round half to even, as z-lab's build_target_layer_ids and SGLang do:
    (30, 5, [1, 8, 14, 20, 27]),  # 7.5 -> 8, 20.5 -> 20
    (10, 5, [1, 2, 4, 6, 7]),  # 2.5 -> 2, 5.5 -> 6
    (64, 5, [1, 16, 31, 46, 61]),
])
def test_build_target_layer_ids_reference_rule(n_layers, n, expected):
    assert build_target_layer_ids(n_layers, n) == expected


def test_legacy_causality_rule_and_explicit_overrides():
    cfg = tiny_drafter_config("mixed_swa")
    assert cfg.layer_specs() == [LayerSpec(5, True), LayerSpec(None, False)]
    assert cfg.uniform_causal is None
    assert tiny_drafter_config("sliding_bidirectional").layer_specs() == [LayerSpec(6, False)] * 2
    assert tiny_drafter_config("mixed_per_layer").causal_flags == [True, False]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("features", [{}, {"attention_sink_bias": True,
                                           "learned_mask_embedding": True}])
def test_serving_dict_round_trip(layout, features):
    cfg = tiny_drafter_config(layout, **features)
    back = DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    assert back.layer_specs() == cfg.layer_specs()


def test_serving_keys_follow_the_contract():
    d = tiny_drafter_config("sliding_causal", attention_sink_bias=True).to_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["hidden_act"] == "silu" and d["tie_word_embeddings"] is False
    assert d["layer_types"] == ["sliding_attention"] * 2
    assert d["use_sliding_window"] is True and d["sliding_window"] == 6
    assert d["dflash_config"]["swa_window_size"] == 6
    assert d["is_causal"] is True and d["dflash_config"]["causal"] is True
    assert d["block_size"] == d["dflash_config"]["block_size"] == 4
    assert d["dflash_config"]["target_layer_ids"] == [1, 3, 4]
    assert d["dflash_config"]["attention_sink_bias"] is True
    assert "rope_theta" in d and d[TRAINING_SPEC_KEY]["layer_specs"][0] == {
        "window": 6, "causal": True}
    mixed = tiny_drafter_config("mixed_swa").to_dict()
    assert "is_causal" not in mixed and "causal" not in mixed["dflash_config"]


def test_zlab_config_loads_with_its_bookkeeping_keys():
    cfg = DrafterConfig.from_dict(ZLAB_QWEN3_8B, source="z-lab/config.json")
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.block_size == 16
    assert cfg.layer_specs() == [LayerSpec(None, False)] * 5
    assert cfg.variant == "dflash1" and cfg.output_multiplier == 1.0


@pytest.mark.parametrize(("where", "key", "hint"), [
    ("dflash_config", "future_knob", ""),
    ("dflash_config", "selector_topk", "did you mean one of 'selector_top_k'"),
    ("top", "attention_value_scale", ""),
    ("top", "output_multipler", "did you mean 'output_multiplier'"),
])
def test_unknown_keys_are_errors(where, key, hint):
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    (d["dflash_config"] if where == "dflash_config" else d)[key] = 3
    with pytest.raises(ValueError, match=f"unknown key '.*{key}'") as err:
        DrafterConfig.from_dict(d, source="z-lab/config.json")
    assert hint in str(err.value) and "z-lab/config.json" in str(err.value)


def test_unknown_key_in_our_training_spec_is_an_error():
    d = tiny_drafter_config().to_dict()
    d[TRAINING_SPEC_KEY]["is_casual"] = True
    with pytest.raises(ValueError, match="unknown key 'dflash_lab_training_spec.is_casual'"):
        DrafterConfig.from_dict(d)


def test_transformers5_rope_parameters_are_read():
    d = {k: v for k, v in ZLAB_QWEN3_8B.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert DrafterConfig.from_dict(d).rope_theta == 5e5
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    assert DrafterConfig.from_dict(d).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="disagrees with rope_parameters.rope_theta"):
        DrafterConfig.from_dict(dict(d, rope_theta=1e6))


def test_use_swa_without_sliding_layer_types_slides_every_layer_bidirectionally():
    d = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 151669, "use_swa": True,
                                           "swa_window_size": 2048,
                                           "target_layer_ids": [1, 9, 17, 25, 33]})
    assert DrafterConfig.from_dict(d).layer_specs() == [LayerSpec(2048, False)] * 5


def test_explicit_is_causal_is_read_in_precedence_order():
    base = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 1, "causal": False,
                                              "target_layer_ids": [1, 9, 17, 25, 33]})
    assert DrafterConfig.from_dict(base).causal_flags == [False] * 5
    assert DrafterConfig.from_dict(dict(base, is_causal=True)).causal_flags == [True] * 5


@pytest.mark.parametrize(("override", "key", "hint"), [
    ({"layer_types": ["full_attention"]}, "layer_types", "one entry per draft layer"),
    ({"layer_types": ["full_attention", "local"]}, "layer_types", "not one of"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": None}, "sliding_window",
     "needs sliding_window"),
    ({"target_layer_ids": [1, 6]}, "target_layer_ids", "outside"),
    ({"target_layer_ids": [1, 1]}, "target_layer_ids", "distinct"),
    ({"mask_token_id": 97}, "mask_token_id", "vocab_size=97"),
    ({"num_attention_heads": 5}, "num_attention_heads", "must divide hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide num_attention_heads"),
    ({"is_causal": [True]}, "is_causal", "per-layer list"),
    ({"block_size": 1}, "block_size", ">= 2"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling", "not supported"),
])
def test_validation_errors_name_key_and_fix(override, key, hint):
    with pytest.raises(ValueError, match=key) as err:
        tiny_drafter_config(**override)
    assert hint in str(err.value)
    assert "tiny_drafter_config" in str(err.value)  # names where the config came from


def test_unknown_key_in_our_config_is_an_error_with_a_suggestion():
    with pytest.raises(ValueError, match="did you mean one of 'block_size'"):
        tiny_drafter_config(blocksize=8)
    with pytest.raises(ValueError, match="unknown drafter key 'selector_topk'.*'selector_top_k'"):
        tiny_drafter_config(variant="dflash2", selector_topk=8)


def test_integer_target_layer_ids_use_the_reference_rule():
    cfg = tiny_drafter_config(num_target_layers=36, target_layer_ids=5)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]


def test_json_file_round_trip_and_bad_json(tmp_path):
    cfg = tiny_drafter_config("mixed_swa")
    path = tmp_path / "config.json"
    cfg.save_json(path)
    assert DrafterConfig.from_json(path) == cfg
    path.write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        DrafterConfig.from_json(path)


def test_missing_required_keys_are_reported():
    with pytest.raises(ValueError, match="missing required keys"):
        DrafterConfig.from_dict({"hidden_size": 8})


def test_hydra_containers_become_plain_python():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"is_causal": [True, False], "layer_types": ["full_attention"] * 2,
                             "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    cfg = tiny_drafter_config(is_causal=node.is_causal, layer_types=node.layer_types,
                              rope_scaling=node.rope_scaling)
    assert type(cfg.is_causal) is list and type(cfg.layer_types) is list
    assert type(cfg.rope_scaling) is dict
    json.dumps(cfg.to_dict())
