"""DFlash 2 drafter: config, conv, selector, identity init, train/infer parity, z-lab parity."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.export.engines.zlab import base_config
from dflash_lab.heads.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_lab.model.config import DFLASH2_DEFAULTS, DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from tests.doubles import LAYOUTS, tiny_drafter_config

ZLAB_PYTHON = REPO_ROOT / ".venv-dflash" / "bin" / "python"
#: tiny DFlash 2 shape: H=48 -> 4 conv groups of 12; K=3 taps inside blocks of 4; rank 8, top 5
V2 = {"variant": "dflash2", "conv_kernel_size": 3, "conv_group_size": 12, "selector_rank": 8,
      "selector_top_k": 5}
SCALES = {"input_embedding_scale": 1.7, "output_multiplier": 0.6, "final_logit_softcapping": 4.0}


# ---------------------------------------------------------------------------- config
def test_dflash2_defaults_are_the_released_setting_and_v2_fields_need_the_variant():
    cfg = tiny_drafter_config(variant="dflash2", hidden_size=64, num_attention_heads=4)
    assert {k: getattr(cfg, k) for k in DFLASH2_DEFAULTS} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
    assert cfg.variant == "dflash2" and tiny_drafter_config().variant == "dflash1"
    with pytest.raises(ValueError, match="selector_rank=8: is a DFlash 2 field; set variant="):
        tiny_drafter_config(selector_rank=8)


@pytest.mark.parametrize(("override", "key", "hint"), [
    ({"conv_group_size": 10}, "conv_group_size", "must divide hidden_size=48"),
    ({"conv_kernel_size": 5}, "conv_kernel_size", "<= block_size=4"),
    ({"conv_kernel_size": 0}, "conv_kernel_size", "positive integer"),
    ({"selector_rank": 0}, "selector_rank", "positive integer"),
    ({"selector_top_k": 98}, "selector_top_k", "<= vocab_size=97"),
    ({"variant": "dflash3"}, "variant", "one of ['dflash1', 'dflash2', "),  # every head's name
    ({"input_embedding_scale": 0.0}, "input_embedding_scale", "> 0"),
    ({"output_multiplier": float("inf")}, "output_multiplier", "finite"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping", "or null"),
])
def test_dflash2_validation_names_the_field_and_the_fix(override, key, hint):
    with pytest.raises(ValueError, match=key) as err:
        tiny_drafter_config(**{**V2, **override})
    assert hint in str(err.value) and "tiny_drafter_config" in str(err.value)


@pytest.mark.parametrize("features", [V2, {**V2, **SCALES}, SCALES])
@pytest.mark.parametrize("layout", ["full_bidirectional", "mixed_swa"])
def test_serving_dict_round_trip_in_zlab_flat_layout(layout, features):
    cfg = tiny_drafter_config(layout, **features)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert DrafterConfig.from_dict(d) == cfg
    v2 = features.get("variant") == "dflash2"
    assert d["architectures"] == ["DFlash2DraftModel" if v2 else "DFlashDraftModel"]
    written = {k: d["dflash_config"][k] for k in (*DFLASH2_DEFAULTS, *SCALES)
               if k in d["dflash_config"]}
    assert written == {k: v for k, v in features.items() if k != "variant"}


def test_dflash1_serving_dict_is_unchanged_by_the_new_fields():
    d = tiny_drafter_config().to_dict()
    # sample_from_anchor is a DFlash 1 key, always written (engines default it differently)
    assert set(d["dflash_config"]) == {"mask_token_id", "target_layer_ids", "block_size",
                                       "attention_sink_bias", "causal", "sample_from_anchor"}


def _v2_dict(**dflash_extra):
    d = tiny_drafter_config(**V2).to_dict()
    d.pop("dflash_lab_training_spec")
    d["dflash_config"].update(dflash_extra)
    return d


def test_variant_is_read_from_architectures_or_the_v2_keys():
    d = _v2_dict()
    assert base_config({k: v for k, v in d.items() if k != "architectures"},
                       "z").variant == "dflash2"
    with pytest.raises(ValueError, match=r"DFlash 2 keys .*architectures to \['DFlash2DraftModel'"):
        base_config(dict(d, architectures=["DFlashDraftModel"]), "z")
    with pytest.raises(ValueError, match="is not a DFlash drafter"):
        base_config(dict(d, architectures=["Qwen3ForCausalLM"]), "z")
    del d["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match=r"needs \['dflash_config.selector_top_k'\]"):
        base_config(d, "z")


def test_zlab_lookup_order_and_softcap_zero_means_off():
    d = _v2_dict(final_logit_softcapping=0.0)
    assert base_config(d, "z").final_logit_softcapping is None  # z-lab: <= 0 is off
    top = dict(d, output_multiplier=0.5, input_embedding_scale=2.0)  # top level is read too
    top["dflash_config"] = dict(d["dflash_config"], input_embedding_scale=3.0)  # ... after this
    cfg = base_config(top, "z")
    assert cfg.output_multiplier == 0.5 and cfg.input_embedding_scale == 3.0


# ---------------------------------------------------------------------------- conv
def _reference_conv(x, dyn, base, block_size, group_size):
    """Scalar loops straight from the formula: out[t,c] = sum_o (base[o,c] + dyn[t,o,g]) x[t-o,c]
    with t - o inside t's block."""
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for o in range(base.shape[0]):
            if t % block_size - o < 0:
                continue
            for c in range(x.shape[2]):
                out[:, t, c] += (base[o, c] + dyn[:, t, o, c // group_size]) * x[:, t - o, c]
    return out


def _random_conv(seed=0, hidden=8, k=3, group=2, block=4):
    torch.manual_seed(seed)
    conv = GroupedDynamicCausalConv(hidden, k, group, block).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    return conv


def test_conv_matches_the_formula_on_packed_blocks():
    conv = _random_conv()
    x = torch.randn(2, 12, 8, dtype=torch.float64)  # 3 blocks of 4
    dyn = conv.kernel_projection(x).view(2, 12, 2, 3, 4)
    out, dyn_out = conv.prepare(x)
    torch.testing.assert_close(out, _reference_conv(x, dyn[:, :, 0], conv.base_kernel[0], 4, 2))
    torch.testing.assert_close(dyn_out, dyn[:, :, 1])
    y = torch.randn_like(x)
    torch.testing.assert_close(conv.finish(y, dyn_out),
                               _reference_conv(y, dyn[:, :, 1], conv.base_kernel[1], 4, 2))


@pytest.mark.parametrize("slot", [0, 3])
def test_conv_taps_never_cross_a_block_start(slot):
    """Perturb slot 0 of block 1 (slot=0) or the last slot of block 0 (slot=3): the other
    block's outputs stay bit-identical, while the perturbed block does change."""
    conv = _random_conv()
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    pos = 4 if slot == 0 else 3
    x2 = x.clone()
    x2[:, pos] += 1.0
    (a, da), (b, db) = conv.prepare(x), conv.prepare(x2)
    other = slice(0, 4) if slot == 0 else slice(4, 8)
    own = slice(4, 8) if slot == 0 else slice(0, 4)
    assert torch.equal(a[:, other], b[:, other]) and torch.equal(da[:, other], db[:, other])
    assert not torch.allclose(a[:, own], b[:, own])
    y = torch.randn_like(x)
    y2 = y.clone()
    y2[:, pos] += 1.0
    assert torch.equal(conv.finish(y, da)[:, other], conv.finish(y2, da)[:, other])
    if slot == 0:  # a tap inside the block reaches the next slot
        assert not torch.allclose(conv.finish(y, da)[:, 5], conv.finish(y2, da)[:, 5])


def test_fresh_conv_is_the_identity_and_fresh_selector_scores_are_unary():
    conv = GroupedDynamicCausalConv(8, 3, 2, 4)
    x = torch.randn(2, 8, 8)
    out, dyn = conv.prepare(x)
    assert torch.equal(out, x) and torch.equal(conv.finish(x, dyn), x)
    sel = CandidateSelector(8, 11, 4, 3)
    unary = torch.randn(2, 5, 11)
    vals, ids = sel.candidates(unary)
    scores = sel.score(torch.randn(2, 5, 8), torch.randint(0, 11, (2, 5)), ids, vals)
    assert torch.equal(scores, vals)


# ---------------------------------------------------------------------------- drafter
def _randomize_v2(drafter):
    """Non-identity conv and selector weights, large enough to change hidden states and picks."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "base_kernel" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif "kernel_projection" in name or "hidden_projection" in name:
                p.copy_(torch.randn_like(p) * 0.3)
            elif "codebook" in name:
                p.copy_(torch.randn_like(p))


def _setup(layout="full_bidirectional", dtype=torch.float64, randomize=True, seed=0, **features):
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(layout, **{**V2, **features})
    drafter = DFlashDrafter(cfg).to(dtype)
    if randomize:
        _randomize_v2(drafter)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dtype).requires_grad_(False)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(dtype)
    with torch.no_grad():
        lm_head.weight.normal_()
    s = 23
    hidden = torch.randn(2, s, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, s))
    anchors = torch.tensor([[1, 4, 5, 12, 19], [2, 3, 9, 15, 15]])
    return cfg, drafter, embed, lm_head, hidden, ids, anchors


def test_state_dict_uses_zlab_names():
    cfg, drafter, *_ = _setup()
    keys = set(drafter.state_dict())
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            assert {f"layers.{i}.{conv}.base_kernel",
                    f"layers.{i}.{conv}.kernel_projection.weight"} <= keys
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= keys
    assert drafter.state_dict()["layers.0.attention_conv.kernel_projection.weight"].shape == (
        2 * 3 * 4, 48)
    assert drafter.state_dict()["candidate_selector.successor_codebook"].shape == (97, 8)


@pytest.mark.parametrize("layout", ["full_bidirectional", "sliding_causal", "mixed_per_layer"])
def test_fresh_dflash2_drafts_exactly_like_dflash1(layout):
    """Same weights otherwise: same hidden states (training and inference), same greedy draft."""
    cfg2, v2, embed, lm_head, hidden, ids, anchors = _setup(layout, randomize=False)
    v1 = DFlashDrafter(tiny_drafter_config(layout)).double()
    missing, unexpected = v1.load_state_dict(v2.state_dict(), strict=False)
    assert not missing and all("conv" in k or "selector" in k for k in unexpected)
    with torch.no_grad():
        assert torch.equal(v2(hidden, ids, anchors, embed), v1(hidden, ids, anchors, embed))
    drafts = []
    for model in (v1, v2):
        cache = model.new_cache()
        model.extend_context(cache, hidden[:, :11])
        out = model.draft(cache, ids[:, 11], embed)
        drafts.append((out, model.propose(out, ids[:, 11], lm_head)))
    assert torch.equal(drafts[0][0], drafts[1][0]) and torch.equal(drafts[0][1], drafts[1][1])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dflash2_train_and_inference_paths_give_the_same_block(layout):
    cfg, drafter, embed, lm_head, hidden, ids, anchors = _setup(layout, **SCALES)
    with torch.no_grad():
        packed = drafter(hidden, ids, anchors, embed)  # [2, N, B, H]
    for row in range(2):
        for j, anchor in enumerate(anchors[row].tolist()):
            cache = drafter.new_cache()
            drafter.extend_context(cache, hidden[row:row + 1, :anchor])
            single = drafter.draft(cache, ids[row:row + 1, anchor], embed)
            torch.testing.assert_close(single[0], packed[row, j], rtol=1e-9, atol=1e-9)


def test_conv_and_selector_change_the_draft_when_not_identity():
    """Guards the fixtures: the random weights really move hidden states and selector picks."""
    cfg, drafter, embed, lm_head, hidden, ids, anchors = _setup()
    fresh = _setup(randomize=False)[1]
    with torch.no_grad():
        out = drafter(hidden, ids, anchors, embed)  # [2, N, B, H]
        assert not torch.allclose(out, fresh(hidden, ids, anchors, embed))
        unary_top1 = drafter.unary_logits(out[:, :, 1:], lm_head).argmax(-1).flatten(0, 1)
        picks = drafter.propose(out.flatten(0, 1), ids.gather(1, anchors).flatten(), lm_head)
    assert picks.shape == unary_top1.shape == (10, 3) and (picks != unary_top1).any()


def selector_scores(drafter, hidden_xth, prev_ids_xt, lm_head):
    """Teacher-forced selector scores as training computes them (``CandidateSelector.score``
    over the unary top-K): (scores [x, T, C], candidate ids, their unary logits)."""
    selector = drafter.candidate_selector
    cand_unary, cand_ids = selector.candidates(drafter.unary_logits(hidden_xth, lm_head))
    return selector.score(hidden_xth, prev_ids_xt, cand_ids, cand_unary), cand_ids, cand_unary


def test_teacher_forced_scores_equal_the_walk_given_the_walked_tokens():
    """Training's scoring and serving's walk are one computation: feeding the walk's own picks
    as the true previous tokens reproduces its scores."""
    cfg, drafter, embed, lm_head, hidden, ids, anchors = _setup(**SCALES)
    cache = drafter.new_cache()
    drafter.extend_context(cache, hidden[:, :11])
    out = drafter.draft(cache, ids[:, 11], embed)
    unary = drafter.unary_logits(out[:, 1:], lm_head)
    vals, cand = drafter.candidate_selector.candidates(unary)
    tokens, walk_scores = drafter.candidate_selector.walk(out[:, 1:], cand, vals, ids[:, 11])
    prev = torch.cat([ids[:, 11:12], tokens[:, :-1]], dim=1)
    scores, cand2, vals2 = selector_scores(drafter, out[:, 1:], prev, lm_head)
    torch.testing.assert_close(scores, walk_scores)
    assert torch.equal(cand2, cand)
    assert torch.equal(tokens, cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0])


def test_unary_logits_apply_multiplier_then_softcap_and_scale_reaches_block_inputs():
    cfg, drafter, embed, lm_head, *_ = _setup(**SCALES)
    h = torch.randn(3, 48, dtype=torch.float64)
    want = torch.tanh(lm_head(h) * 0.6 / 4.0) * 4.0
    torch.testing.assert_close(drafter.unary_logits(h, lm_head), want)
    anchors = torch.tensor([[5, 7]])
    plain = DFlashDrafter(tiny_drafter_config(**V2)).double()
    torch.testing.assert_close(drafter.block_inputs(anchors, embed),
                               plain.block_inputs(anchors, embed) * 1.7)


# ---------------------------------------------------------------------------- z-lab parity
ZLAB_CASES = {
    "dflash2_full": ("full_bidirectional", {**V2, **SCALES}),
    "dflash2_mixed_swa": ("mixed_swa", V2),
    "dflash1_scales": ("sliding_causal", SCALES),
}


def _write_case(path: Path, layout: str, features: dict) -> dict:
    """Our config.json + model.safetensors + fixed inputs; returns our own outputs."""
    torch.manual_seed(1)
    cfg = tiny_drafter_config(layout, **features)
    drafter = DFlashDrafter(cfg).float()
    _randomize_v2(drafter)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()},
              str(path / "model.safetensors"))
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    with torch.no_grad():
        lm_head.weight.normal_()
    ctx = torch.randn(2, 9, len(cfg.target_layer_ids) * cfg.hidden_size)
    anchor = torch.tensor([3, 50])
    block = torch.full((2, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = anchor
    save_file({"target_hidden": ctx, "block_ids": block, "embed_weight": embed.weight.data,
               "lm_head_weight": lm_head.weight.data}, str(path / "inputs.safetensors"))
    with torch.no_grad():
        cache = drafter.new_cache()
        drafter.extend_context(cache, ctx)
        hidden = drafter.draft(cache, anchor, embed)
        ours = {"hidden": hidden, "logits": drafter.unary_logits(hidden[:, 1:], lm_head),
                "tokens": drafter.propose(hidden, anchor, lm_head)}
        if cfg.variant == "dflash2":
            ours["candidates"] = drafter.candidate_selector.candidates(
                ours["logits"])[1].sort(-1).values
    return ours


@pytest.fixture(scope="module")
def zlab_runs(tmp_path_factory):
    if not ZLAB_PYTHON.exists():
        pytest.skip("needs .venv-dflash (make dflash-venv): z-lab's released dflash 0.1.0")
    root = tmp_path_factory.mktemp("zlab")
    ours = {name: _write_case(root / name, *case) for name, case in ZLAB_CASES.items()}
    proc = subprocess.run([str(ZLAB_PYTHON), "-m", "scripts.zlab_parity",
                           *(str(root / n) for n in ZLAB_CASES)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {n: (ours[n], load_file(str(root / n / "zlab_outputs.safetensors")))
            for n in ZLAB_CASES}


@pytest.mark.parametrize("case", sorted(ZLAB_CASES))
def test_matches_zlab_released_drafter(zlab_runs, case):
    """z-lab's DFlash2DraftModel / DFlashDraftModel, loaded from the directory we wrote, gives
    our hidden states, unary logits, candidates and greedy draft (float32)."""
    ours, theirs = zlab_runs[case]
    assert sorted(ours) == sorted(theirs)
    for key in ("hidden", "logits"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=key: f"{case} {k}: {m}")
    for key in ("tokens", "candidates"):
        if key in ours:
            assert torch.equal(ours[key], theirs[key]), f"{case} {key}"
    if case.startswith("dflash2"):  # the selector really re-ranked something
        assert (ours["tokens"] != ours["logits"].argmax(-1)).any(), case
