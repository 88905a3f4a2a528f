"""The LiLiCorr head (dflash_lab/heads/lilicorr.py; docs/design/new_heads.md "LiLiCorr"): the
engines' tensor names and shapes (plain and with DFlash 2's conv), their refusals, the lattice
walk against the teacher-forced rows it is trained on, the T > 0 q, and one training step of
ModelOpt's objective."""

import json

import pytest
import torch

from dflash_lab.heads import lilicorr
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.module import DFlashModule
from tests.doubles import tiny_drafter_config

B, K = 6, 4
FIELDS = {"lilicorr_candidate_topk": K, "lilicorr_hidden_size": 32, "lilicorr_num_layers": 2,
          "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
          "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}
CONV = {"conv_kernel_size": 2, "conv_group_size": 16}


def _config(**fields):
    return tiny_drafter_config(**{"variant": "lilicorr", "block_size": B, **FIELDS, **fields})


def _drafter(seed=0, **fields):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(_config(**fields))
    with torch.no_grad():  # embeddings and biases away from their zero init: the walk moves
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return drafter.eval()


@pytest.mark.parametrize("conv", [{}, CONV])
def test_engine_names_and_shapes_and_config_round_trip(conv):
    config = _config(**conv)
    state = DFlashDrafter(config).state_dict()
    head = {n: tuple(t.shape) for n, t in state.items() if n.startswith("lilicorr.")}
    assert len(head) == 46  # 44 for two layers + token_proj (h = 32 != H = 48)
    expected = config.head.weight_shapes(config)
    assert {n: tuple(state[n].shape) for n in expected} == expected
    assert head["lilicorr.slot_embedding"] == (1, 1, B - 1, 1, 32)
    assert head["lilicorr.rank_embedding"] == (1, 1, 1, K, 32)
    assert head["lilicorr.relative_slot_bias"] == (4, 2 * B - 1)
    assert head["lilicorr.layers.1.attn.in_proj_weight"] == (96, 32)
    assert head["lilicorr.layers.0.mlp.up_proj.weight"] == (64, 32)
    assert head["lilicorr.feature_mlp.up_proj.weight"] == (32, 5)
    assert head["lilicorr.factor_input_proj.weight"] == (32, 96)
    assert head["lilicorr.anchor_out_head.bias"] == (8,)
    assert ("layers.1.mlp_conv.base_kernel" in expected) == bool(conv)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["architectures"] == ["LiLiCorrDraftModel"]
    assert {k: data["dflash_config"][k] for k in FIELDS} == FIELDS
    assert ("conv_kernel_size" in data["dflash_config"]) == bool(conv)
    assert DrafterConfig.from_dict(data) == config
    bare = {k: v for k, v in data.items() if k != "architectures"}  # told apart by its keys
    assert DrafterConfig.from_dict(bare).variant == "lilicorr"
    assert "lilicorr.token_proj.weight" not in _config(lilicorr_hidden_size=0).head.weight_shapes(
        _config(lilicorr_hidden_size=0))


@pytest.mark.parametrize("field, value, message", [
    ("lilicorr_candidate_topk", 3, "must be a power of two in \\[1, 16\\]"),
    ("lilicorr_candidate_topk", 32, "must be a power of two in \\[1, 16\\]"),
    ("lilicorr_candidate_topk", 0, "must be a power of two in \\[1, 16\\]"),
    ("lilicorr_num_heads", 3, "must be an integer >= 1 dividing the lattice width"),
    ("lilicorr_logit_scale", None, "must be a number > 0 \\(required: no engine defaults it\\)"),
    ("lilicorr_vector_eps", 0.6, "must be in \\(0, 0.5\\)"),
    ("lilicorr_hidden_size", -1, "must be an integer >= 0"),
    ("lilicorr_mlp_ratio", 0.0, "must be a number > 0"),
    ("lilicorr_factor_dim", 0, "must be an integer >= 1"),
    ("output_multiplier", 2.0, "leave it at 1.0"),
    ("sample_from_anchor", True, "leave it at False"),
])
def test_validation_refuses_what_the_engines_refuse(field, value, message):
    with pytest.raises(ValueError, match=f"invalid {field}=.*{message}"):
        _config(**{field: value})


def test_conv_group_must_divide_and_dflash2_keeps_its_conv_defaults():
    with pytest.raises(ValueError, match="invalid conv_kernel_size=None: .*set both or neither"):
        _config(conv_group_size=16)
    with pytest.raises(ValueError, match="invalid conv_group_size=5: must divide hidden_size=48"):
        _config(conv_kernel_size=2, conv_group_size=5)
    assert _config().conv_kernel_size is None
    assert tiny_drafter_config(variant="dflash2").conv_kernel_size == 2


def _inputs(seed, slots=B - 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, 48, generator=g), torch.randn(slots, 97, generator=g) * 3,
            torch.randn(48, generator=g))


def test_walk_follows_the_rows_training_teacher_forces():
    """Fed its own drafts as gold, each teacher-forced node row's argmax is the walk's pick; the
    hook's candidates are the top-K of log_softmax(unary)."""
    drafter, embed = _drafter(), torch.nn.Embedding(97, 48)
    moved = 0
    for seed in range(5):
        hidden, unary, ctx = _inputs(seed)
        tokens, q = drafter.config.head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None,
                                              embed, ctx)
        lp, ids = drafter.lilicorr.candidates(unary)
        assert q is None and torch.equal(ids, unary.topk(K).indices)
        with torch.no_grad():
            scores = drafter.lilicorr(embed(ids)[None], lp[None], hidden[None], ctx[None],
                                      torch.ones(1))
        sup, sums = lilicorr.lattice_losses(scores, ids[None], tokens[None], torch.ones(1).bool(),
                                            None, 2.0)
        assert sup.all()
        gold = (ids == tokens[:, None]).float().argmax(-1)
        prev = torch.cat([torch.zeros(1, dtype=torch.long), gold[:-1]])
        node = scores[0, torch.arange(B - 1), prev]
        assert torch.equal(node.argmax(-1), gold)
        assert sums["margin"] < 2.0 * (B - 1)  # the gold leads its row
        moved += int(not torch.equal(tokens, unary.argmax(-1)))
    assert moved, "fixture: the lattice must change some draft"


def test_temperature_q_is_softmax_of_the_walked_rows_and_needs_the_context():
    drafter, embed = _drafter(), torch.nn.Embedding(97, 48)
    hidden, unary, ctx = _inputs(1)
    tokens, q = drafter.config.head.draft(drafter, hidden, unary, 5, 0.7, "rejection",
                                          torch.Generator().manual_seed(0), embed, ctx)
    ids = unary.topk(K).indices
    torch.testing.assert_close(q.sum(-1), torch.ones(B - 1))
    torch.testing.assert_close(q.gather(-1, ids).sum(-1), q.sum(-1))  # zero outside the K
    assert bool((q.gather(-1, tokens[:, None]) > 0).all())
    with torch.no_grad():  # slot 0's row is softmax(start / T)
        lp = torch.log_softmax(unary, -1).gather(-1, ids)
        start = drafter.lilicorr(embed(ids)[None], lp[None], hidden[None], ctx[None],
                                 torch.ones(1))[0, 0, 0]
    torch.testing.assert_close(q[0, ids[0]], torch.softmax(start / 0.7, -1))
    with pytest.raises(ValueError, match="context row before the anchor"):
        drafter.config.head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None, embed)


def _module(drafter, **settings):
    drafter.train()
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(97, 48)
    head.lm_head = torch.nn.Linear(48, 97, bias=False)
    return DFlashModule(drafter, head, optimizer=torch.optim.SGD, gamma=4.0,
                        label_source="dataset", head=settings,
                        target_distribution={"last_hidden": True})


@pytest.mark.parametrize("conv", [{}, CONV])
def test_one_training_step_reaches_the_lattice_and_the_backbone(conv):
    module = _module(_drafter(**conv), w_ce=0.125, w_margin=0.125, w_pen=0.25)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, K, (2, 24), generator=g)  # every gold in every lattice
    batch = {"hidden": torch.randn(2, 24, 3 * 48, generator=g), "input_ids": ids,
             "loss_mask": torch.ones(2, 24), "target_last_hidden": torch.randn(2, 24, 48)}
    with torch.no_grad():  # tokens 0..K-1 are every slot's top K
        module.target_head.lm_head = torch.nn.Linear(48, 97)
        module.target_head.lm_head.bias.zero_()[:K] = 30.0
    anchors, valid = torch.tensor([[0, 8, 15]] * 2), torch.ones(2, 3, dtype=torch.bool)
    out = module.blocks_loss(batch, anchors, valid)
    found = {t.name: t for t in module.terms(out, 0)}
    assert {"label", "lilicorr_ce", "lilicorr_margin", "lilicorr_pen"} <= set(found)
    assert found["lilicorr_pen"].coef == 0.25 and found["lilicorr_ce"].count > 0
    module.objective(out, 0).backward()
    names = ["lilicorr.layers.0.attn.in_proj_weight", "lilicorr.context_proj.weight",
             "lilicorr.anchor_out_head.weight", "fc.weight"]
    if conv:
        names.append("layers.0.mlp_conv.kernel_projection.weight")
    for name in names:
        assert module.drafter.get_parameter(name).grad.abs().sum() > 0, name


def test_settings_are_refused_as_modelopt_refuses():
    with pytest.raises(ValueError, match="not all zero"):
        _module(_drafter(), w_ce=0.0, w_margin=0.0, w_pen=0.0)
    with pytest.raises(ValueError, match="module.head.w_pen needs the target's next-token"):
        DFlashModule(_drafter(), _module(_drafter()).target_head, optimizer=torch.optim.SGD)


def test_context_rows_are_cached_only_for_the_head_that_reads_them():
    """A DFlash 1 drafter's context cache holds no fused rows [Bt, C, H] (memory); LiLiCorr's holds
    the fused rows of the committed positions (after a crop too), and its draft from the cached
    last row is the draft from the row fused afresh."""
    feats = torch.randn(1, 7, _config().num_features, generator=torch.Generator().manual_seed(3))
    plain = DFlashDrafter(tiny_drafter_config(block_size=B)).eval()
    cache = plain.new_cache()
    plain.extend_context(cache, feats)
    assert cache.rows is None and cache.length == 7
    drafter, embed = _drafter(), torch.nn.Embedding(97, 48)
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats[:, :5])
    cache.crop(3)
    drafter.extend_context(cache, feats[:, 5:])
    with torch.no_grad():
        fused = drafter.fuse(torch.cat([feats[:, :3], feats[:, 5:]], 1))
    torch.testing.assert_close(cache.rows, fused)
    hidden, unary, _ = _inputs(2)
    head = drafter.config.head
    cached = head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None, embed,
                        cache.rows[0, -1])
    fresh = head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None, embed, fused[0, -1])
    assert torch.equal(cached[0], fresh[0])
