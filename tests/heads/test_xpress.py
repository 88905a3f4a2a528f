"""The XPress head (dflash_lab/heads/xpress.py; docs/design/new_heads.md "XPress"): vLLM 0.34's
tensor names and shapes and top-level keys, its refusals, the Jacobi walk against the sequential
greedy decode it converges to, top-C, and one training step of speculators' objective."""

import json

import pytest
import torch

from dflash_lab.heads import xpress
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.module import DFlashModule
from tests.doubles import tiny_drafter_config

B, V, H = 6, 97, 48


def _config(**fields):
    return tiny_drafter_config(**{"variant": "xpress", "xpress_rank": 8, "xpress_mlp_hidden": 16,
                                  "xpress_topc": 0, "block_size": B, **fields})


def _drafter(seed=0, **fields):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(_config(**fields))
    with torch.no_grad():  # a refiner large enough to change drafts
        for p in drafter.xpress_head.parameters():
            p.normal_(std=1.0)
    return drafter.eval()


def test_vllm_names_shapes_and_top_level_keys_round_trip():
    config = _config()
    shapes = {n: tuple(t.shape) for n, t in DFlashDrafter(config).state_dict().items()
              if n.startswith("xpress_head.")}
    assert shapes == xpress.XPress().weight_shapes(config) == {
        "xpress_head.w1.weight": (V, 8), "xpress_head.down_h.weight": (8, H),
        "xpress_head.down_g.weight": (8, H), "xpress_head.in_proj.weight": (8, 24),
        "xpress_head.mix.L": (8, B, B), "xpress_head.mlp.gate_proj.weight": (16, 8),
        "xpress_head.mlp.up_proj.weight": (16, 8), "xpress_head.mlp.down_proj.weight": (8, 16),
        "xpress_head.w2.weight": (V, 8)}
    data = json.loads(json.dumps(config.to_dict()))
    assert data["architectures"] == ["Qwen3XPressModel"]
    assert {k: data[k] for k in xpress.DEFAULTS} == {
        "xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 0, "xpress_num_passes": 6,
        "xpress_block_size": B}
    assert not set(xpress.DEFAULTS) & set(data["dflash_config"])  # vLLM reads the top level
    assert DrafterConfig.from_dict(data) == config


@pytest.mark.parametrize("field, value, message", [
    ("xpress_rank", 0, "must be an integer >= 1"),
    ("xpress_mlp_hidden", 2.5, "must be an integer >= 1"),
    ("xpress_num_passes", 0, "must be an integer >= 1"),
    ("xpress_topc", -1, r"must be an integer in \[0, 97\]"),
    ("xpress_topc", 98, r"must be an integer in \[0, 97\]"),
    ("xpress_block_size", B + 1, "must equal block_size"),
    ("sample_from_anchor", True, "must be false for XPress"),
    ("output_multiplier", 2.0, "leave it at 1.0"),
])
def test_validation_refuses_what_vllm_refuses(field, value, message):
    with pytest.raises(ValueError, match=f"invalid {field}=.*{message}"):
        _config(**{field: value})


def _sequential(refiner, hidden_bh, base_kv, anchor):
    """The greedy decode the Jacobi passes converge to: slot b from the drafts before it."""
    blk = [anchor]
    hcache = refiner.hidden_cache(hidden_bh)
    for b in range(1, base_kv.shape[0] + 1):
        prev = torch.tensor([anchor] + blk[:b])
        lat = refiner.latent(prev, hcache[: b + 1])[b]
        blk.append(int((base_kv[b - 1] + refiner.w2(lat)).argmax()))
    return torch.tensor(blk[1:])


def test_jacobi_walk_converges_to_the_sequential_greedy_decode_and_top_c():
    drafter, changed = _drafter(), 0
    refiner = drafter.xpress_head
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        hidden_bh, base = torch.randn(B, H, generator=g), torch.randn(B - 1, V, generator=g)
        with torch.no_grad():
            seq = _sequential(refiner, hidden_bh, base, seed + 3)
        tokens = xpress.jacobi_walk(refiner, hidden_bh, base, seed + 3, passes=B - 1)
        assert torch.equal(tokens, seq)  # B - 1 passes settle every slot
        # a shorter tail keeps the full walk's first drafts (the mixer is causal)
        assert torch.equal(xpress.jacobi_walk(refiner, hidden_bh, base[:2], seed + 3, B - 1),
                           seq[:2])
        changed += int(not torch.equal(tokens, base.argmax(-1)))
        assert torch.equal(xpress.jacobi_walk(refiner, hidden_bh, base, seed + 3, B - 1, V),
                           tokens)  # top-C of the whole vocabulary is exact
        small = xpress.jacobi_walk(refiner, hidden_bh, base, seed + 3, B - 1, 3)
        assert all(t in base[i].topk(3).indices for i, t in enumerate(small.tolist()))
    assert changed  # the refiner changed some draft: the test sees the refiner path


def test_draft_hook_reads_the_block_rows_and_is_a_point_mass_at_temperature():
    drafter = _drafter()
    hidden, unary = torch.randn(B, H), torch.randn(B - 1, V)
    tokens, q = drafter.config.head.draft(drafter, hidden, unary, 5, 0.8, "rejection", None)
    assert torch.equal(tokens, xpress.jacobi_walk(drafter.xpress_head, hidden, unary, 5, 6))
    assert torch.equal(q.argmax(-1), tokens) and torch.equal(q.sum(-1), torch.ones(B - 1))
    assert drafter.config.head.draft(drafter, hidden, unary, 5, 0.0, "greedy", None)[1] is None


def _module(loss="ce", **settings):
    drafter = _drafter()
    drafter.train()
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(V, H)
    head.lm_head = torch.nn.Linear(H, V, bias=False)
    return DFlashModule(drafter, head, optimizer=torch.optim.SGD, gamma=4.0,
                        label_source="dataset", head=settings, loss=loss,
                        target_distribution={"last_hidden": True})


def _batch():
    g = torch.Generator().manual_seed(3)
    return ({"hidden": torch.randn(2, 24, 3 * H, generator=g),
             "input_ids": torch.randint(0, 90, (2, 24), generator=g),
             "loss_mask": torch.ones(2, 24)},
            torch.tensor([[0, 8, 15]] * 2), torch.ones(2, 3, dtype=torch.bool))


def test_one_training_step_is_speculators_objective():
    """loss = L(tf) + 0.3 x mean of 3 rounds + 0.6 x L(base); every refiner tensor learns."""
    module = _module()
    batch, anchors, valid = _batch()
    out = module.blocks_loss(batch, anchors, valid)
    found = {t.name: t for t in module.terms(out, 0)}
    assert set(found) == {"label", "xpress_base", "xpress_round0", "xpress_round1",
                          "xpress_round2"}
    means = {n: (t.weighted_sum / t.count).item() for n, t in found.items()}
    loss = module.objective(out, 0)
    assert loss.item() == pytest.approx(means["label"] + 0.6 * means["xpress_base"] + 0.1 * sum(
        means[f"xpress_round{j}"] for j in range(3)), rel=1e-5)
    assert means["label"] != pytest.approx(means["xpress_base"])  # the bias changes the loss
    loss.backward()
    for name in xpress.XPress().weight_shapes(module.drafter.config):
        assert module.drafter.get_parameter(name).grad.abs().sum() > 0, name
    only_tf = _module(consistency_passes=0, base_anchor_weight=0.0)
    assert [t.name for t in only_tf.terms(only_tf.blocks_loss(batch, anchors, valid), 0)] == [
        "label"]


@pytest.mark.parametrize("loss", [{"kl": 1.0}, {"ce": 0.1, "tv": 0.9}])
def test_a_distribution_loss_trains_every_refiner_tensor(loss):
    """module.loss beyond ce for every L (tf and rounds on ConcatHead [W_lm | w2], base): w2 and
    every refiner tensor get a gradient, the loss is finite and a few SGD steps lower it."""
    module = _module(loss)
    with torch.no_grad():  # a trained-looking refiner, not the walk tests' large one
        for p in module.drafter.xpress_head.parameters():
            p.mul_(0.05)
    batch, anchors, valid = _batch()
    batch["target_last_hidden"] = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(module.drafter.parameters(), lr=0.05)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out = module.blocks_loss(batch, anchors, valid)
        base, rounds = out.head_pieces["xpress"]
        assert base.term_sums and all(r.term_sums for r in rounds)  # every L is module.loss
        value = module.objective(out, 0)
        value.backward()
        assert torch.isfinite(value)
        for name in xpress.XPress().weight_shapes(module.drafter.config):
            assert module.drafter.get_parameter(name).grad.abs().sum() > 0, name
        losses.append(value.item())
        opt.step()
    assert losses[-1] < losses[0]


def test_am1_is_the_token_before_the_anchor_except_at_a_start():
    batch, anchors, _ = _batch()
    prev = xpress.am1_prev_ids(batch, torch.zeros(2, 3, B, dtype=torch.long), anchors)
    ids = batch["input_ids"]
    assert prev[0, :, 0].tolist() == [ids[0, 0], ids[0, 7], ids[0, 14]]
    docs = torch.zeros(2, 24, dtype=torch.long)
    docs[:, 8:] = 1  # a document starts at the second anchor
    prev = xpress.am1_prev_ids({**batch, "document_ids": docs}, prev, anchors)
    assert prev[1, 1, 0] == ids[1, 8]


@pytest.mark.parametrize("settings, message", [
    ({"consistency_passes": -1}, "consistency_passes=-1"),
    ({"consistency_weight": "a"}, "consistency_weight='a'"),
    ({"alpha": 1.0}, r"\['alpha'\] are not settings of the XPress head"),
])
def test_training_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        _module(**settings)
