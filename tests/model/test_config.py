"""DrafterConfig: resolution, serving round trip, third-party configs, validation errors."""

import json

import pytest

from dflash_lab.model.config import (
    TRAINING_SPEC_KEY,
    DrafterConfig,
    LayerSpec,
    build_target_layer_ids,
)
from tests.doubles import LAYOUTS, tiny_drafter_config


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


def test_unknown_key_in_our_training_spec_is_an_error():
    d = tiny_drafter_config().to_dict()
    d[TRAINING_SPEC_KEY]["is_casual"] = True
    with pytest.raises(ValueError, match="unknown key 'dflash_lab_training_spec.is_casual'"):
        DrafterConfig.from_dict(d)


def test_our_reader_refuses_a_third_party_config_and_names_the_importer():
    d = tiny_drafter_config().to_dict()
    d.pop(TRAINING_SPEC_KEY)
    with pytest.raises(ValueError,
                       match="no 'dflash_lab_training_spec'.*dflash_lab.export.import_drafter"):
        DrafterConfig.from_dict(d, source="hub/config.json")


@pytest.mark.parametrize(("where", "key", "value"), [
    ("dflash_config", "use_swa", True),  # vLLM's rule, never written by us
    ("dflash_config", "learned_mask_embedding", True),  # ours records it in the training spec
    ("top", "selector_rank", 8),  # z-lab's flat layout; ours writes it in dflash_config
    ("top", "future_knob", 1),
])
def test_our_reader_rejects_keys_we_never_write(where, key, value):
    d = tiny_drafter_config("sliding_causal").to_dict()
    (d["dflash_config"] if where == "dflash_config" else d)[key] = value
    with pytest.raises(ValueError, match=f"unknown key '.*{key}'"):
        DrafterConfig.from_dict(d)


def test_our_reader_takes_the_layout_from_the_training_spec_only():
    """The engine-facing copies (is_causal, dflash_config.causal) are written for the engines;
    our reader does not re-derive causality from them, whatever they say."""
    cfg = tiny_drafter_config("mixed_per_layer")
    d = cfg.to_dict()
    d["is_causal"], d["dflash_config"]["causal"] = True, True
    assert DrafterConfig.from_dict(d).layer_specs() == cfg.layer_specs()


def test_our_block_size_copies_must_agree():
    d = tiny_drafter_config().to_dict()
    d["dflash_config"]["block_size"] = 8
    with pytest.raises(ValueError, match="block_size=4 but dflash_config.block_size=8"):
        DrafterConfig.from_dict(d, source="run/config.json")


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
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4}}, "rope_scaling", "not supported"),
    ({"target_hidden_size": 0}, "target_hidden_size", "positive integer"),
    ({"target_hidden_size": 192, "aux_hidden_norms": True}, "target_hidden_size",
     "laguna_dflash.py"),
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


def test_target_hidden_size_defaults_to_hidden_and_sizes_fc():
    """T (one target layer's feature width) defaults to H and is not written then; a
    multi-stream target's flattened streams (T = 4 x 48) are written top level, where vLLM's
    _get_dflash_fc_input_size reads them, and read back."""
    import torch

    from dflash_lab.model.drafter import DFlashDrafter

    plain = tiny_drafter_config()
    assert plain.target_hidden_size == 48 and plain.num_features == 3 * 48
    assert "target_hidden_size" not in plain.to_dict()
    wide = tiny_drafter_config(target_hidden_size=192)
    d = json.loads(json.dumps(wide.to_dict()))
    assert d["target_hidden_size"] == 192 and d["hidden_size"] == 48
    assert DrafterConfig.from_dict(d) == wide
    drafter = DFlashDrafter(wide)
    assert drafter.fc.weight.shape == (48, 3 * 192)
    assert drafter.fuse(torch.randn(1, 5, 3 * 192)).shape == (1, 5, 48)
    with pytest.raises(ValueError, match=r"width 144, the drafter expects 576 = 3 layers x 192"):
        drafter.fuse(torch.randn(1, 5, 3 * 48))
