"""The drafter's rotary embedding against transformers' own, for every RoPE type it accepts.

transformers' ``Qwen3RotaryEmbedding`` (``ROPE_INIT_FUNCTIONS`` + the attention factor YaRN puts
on cos/sin) is the reference; positions run past ``original_max_position_embeddings`` and past
``max_position_embeddings``. The one documented difference (model/rope.py): dynamic NTK, where
transformers grows the base with the sequence length beyond ``max_position_embeddings`` and the
engines (and the drafter) keep one table.
"""

from __future__ import annotations

import re

import pytest
import torch

from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.layers import RotaryEmbedding
from dflash_lab.model.rope import normalize_scaling

HEAD_DIM, MAX_POS, THETA = 32, 2048, 10000.0
#: below the original length, at it, past it, past max_position_embeddings
POSITIONS = torch.tensor([0, 1, 7, 100, 511, 512, 513, 1500, 2047, 2048, 5000, 40000])

CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn_no_original": {"rope_type": "yarn", "factor": 4.0},  # transformers fills in M
    "yarn_all_keys": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                      "beta_fast": 16, "beta_slow": 2, "truncate": False,
                      "attention_factor": 0.9},
    "yarn_mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128,
                    "mscale": 0.707, "mscale_all_dim": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "legacy_type_key": {"type": "linear", "factor": 2.0},
}


def _drafter_config(scaling, theta: float = THETA) -> DrafterConfig:
    return DrafterConfig.create(
        source="test_rope", hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=HEAD_DIM, intermediate_size=128, vocab_size=100,
        mask_token_id=5, num_target_layers=8, target_layer_ids=[1], rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=MAX_POS)


def _reference(scaling, positions: torch.Tensor, theta: float = THETA):
    """transformers' Qwen3RotaryEmbedding cos/sin for one sequence covering ``positions``."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_theta=theta,
                         rope_scaling=None if scaling is None else dict(scaling))
    rotary = Qwen3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotary_equals_transformers(name):
    scaling = CASES[name]
    ours = RotaryEmbedding(_drafter_config(scaling))
    cos, sin = ours(POSITIONS, torch.float32)
    ref_cos, ref_sin = _reference(scaling, POSITIONS)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    """Without the factor the tables would be unit-norm; transformers' YaRN scales them."""
    cos, sin = RotaryEmbedding(_drafter_config(CASES["yarn"]))(POSITIONS, torch.float32)
    norm = (cos[:, 0] ** 2 + sin[:, 0] ** 2).sqrt()
    torch.testing.assert_close(norm, torch.full_like(norm, 0.1 * torch.log(torch.tensor(4.0))
                                                     .item() + 1.0))


def test_each_scaling_changes_the_table():
    """The cases are not all plain RoPE in disguise (the equality test could not fail)."""
    plain = RotaryEmbedding(_drafter_config(None))(POSITIONS, torch.float32)[0]
    for name, scaling in CASES.items():
        if scaling is not None:
            got = RotaryEmbedding(_drafter_config(scaling))(POSITIONS, torch.float32)[0]
            assert not torch.allclose(got, plain), name


def test_dynamic_is_plain_rope_as_the_engines_precompute_it():
    """transformers' dynamic NTK equals plain RoPE for sequences up to max_position_embeddings
    (M); beyond, it grows the base with the sequence length. vLLM precomputes one table with
    base theta (= transformers' up to M), which is what the drafter computes everywhere."""
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    ours = RotaryEmbedding(_drafter_config(dynamic))
    plain = RotaryEmbedding(_drafter_config(None))
    short = torch.arange(0, MAX_POS, 97)
    torch.testing.assert_close(ours(short, torch.float32), _reference(dynamic, short),
                               rtol=0, atol=0)
    torch.testing.assert_close(ours(POSITIONS, torch.float32), plain(POSITIONS, torch.float32),
                               rtol=0, atol=0)
    long_cos, _ = _reference(dynamic, POSITIONS)  # one sequence of 40001 > M positions
    assert not torch.allclose(ours(POSITIONS, torch.float32)[0], long_cos, atol=1e-3)


def test_normalized_scaling_is_explicit_and_stable():
    cfg = _drafter_config({"type": "yarn", "factor": 4.0})
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": MAX_POS}
    again = normalize_scaling(cfg.rope_scaling, rope_theta=THETA, max_position_embeddings=99,
                              where="x")
    assert again == cfg.rope_scaling  # idempotent: the explicit length is kept
    assert _drafter_config({"rope_type": "default"}).rope_scaling is None
    assert _drafter_config({"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}) \
        .rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(("scaling", "hint"), [
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
      "original_max_position_embeddings": 512}, "'longrope' is not supported: engines build a "
                                                "position-dependent table"),
    ({"rope_type": "ntk", "factor": 2.0}, "'ntk' is not supported"),
    ({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "per-layer-type RoPE .* vLLM 0.32 and SGLang 0.5.23 both raise TypeError"),
    ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5},
     r"keys \['partial_rotary_factor'\] are not read for rope_type 'yarn'"),
    ({"rope_type": "dynamic", "factor": 2.0, "alpha": 3.0}, r"keys \['alpha'\]"),
    ({"rope_type": "linear"}, r"needs \['factor'\]"),
    ({"rope_type": "linear", "factor": 0}, "factor=0 must be a finite number > 0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor > low_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "truncate='no'"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}, "disagrees with rope_theta"),
    ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, "disagree; keep rope_type"),
])
def test_unsupported_rope_is_refused_by_name(scaling, hint):
    with pytest.raises(ValueError, match="test_rope: invalid rope_scaling") as err:
        _drafter_config(scaling)
    assert re.search(hint, str(err.value)), str(err.value)


def test_scaled_rope_round_trips_through_config_json_and_rope_parameters():
    """Our config.json (checkpoints hold the same dict) reads back equal; a transformers 5
    ``rope_parameters``-only file gives the same RoPE; a ``rope_scaling`` contradicting it is an
    error (the engines' Qwen3Config would read rope_scaling)."""
    cfg = _drafter_config(CASES["yarn_all_keys"])
    d = cfg.to_dict()
    assert d["rope_scaling"] == cfg.rope_scaling and d["max_position_embeddings"] == MAX_POS
    assert DrafterConfig.from_dict(d, source="x") == cfg
    params = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    params["rope_parameters"] = {"rope_theta": THETA, **cfg.rope_scaling}
    assert DrafterConfig.from_dict(params, source="x") == cfg
    both = dict(d, rope_parameters={"rope_theta": THETA, **cfg.rope_scaling})
    assert DrafterConfig.from_dict(both, source="x") == cfg  # agreeing copies are fine
    both["rope_parameters"] = {"rope_theta": THETA, "rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling=.* disagrees with rope_parameters"):
        DrafterConfig.from_dict(both, source="x")
