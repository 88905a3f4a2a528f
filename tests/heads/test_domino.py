"""The Domino head (dflash_lab/heads/domino.py; docs/design/new_heads.md "Domino"): SGLang's
tensor names and shapes, the parser's refusals, the greedy walk against the teacher-forced
logits it is trained on, the candidate pool, and one training step of SpecForge's objective."""

import json

import pytest
import torch

from dflash_lab.heads import domino
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.module import DFlashModule
from dflash_lab.train.objective import dflash_loss
from tests.doubles import tiny_drafter_config

B = 6


def _config(**fields):
    return tiny_drafter_config(**{"variant": "domino", "gru_hidden_dim": 8, "emb_dim": 12,
                                  "block_size": B, **fields})


def _drafter(seed=0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(_config())
    with torch.no_grad():  # a correction large enough to change drafts
        drafter.embed_proj[2].weight.normal_(std=3.0)
    return drafter.eval()


def test_sglang_names_and_shapes_and_config_round_trip():
    config = _config()
    shapes = {n: tuple(t.shape) for n, t in DFlashDrafter(config).state_dict().items()
              if n.startswith(("prefix_gru.", "embed_proj."))}
    assert shapes == domino.Domino().weight_shapes(config) == {
        "prefix_gru.weight_ih_l0": (24, 48), "prefix_gru.weight_hh_l0": (24, 8),
        "embed_proj.0.weight": (12, 56), "embed_proj.2.weight": (97, 12)}
    data = json.loads(json.dumps(config.to_dict()))
    assert data["architectures"] == ["DFlashDraftModel"]
    assert {k: data["dflash_config"][k] for k in domino.DEFAULTS} == {
        "projector_type": "domino", "shift_label": False, "pure_draft_prefix_len": 1,
        "gru_hidden_dim": 8, "emb_dim": 12}
    assert DrafterConfig.from_dict(data) == config
    plain = tiny_drafter_config().to_dict()  # DFlash 1 shares the class: told apart by keys
    assert DrafterConfig.from_dict(plain).variant == "dflash1"


@pytest.mark.parametrize("field, value, message", [
    ("pure_draft_prefix_len", 0, "must be exactly 1"),
    ("pure_draft_prefix_len", 2, "must be exactly 1"),
    ("shift_label", "no", "must be false"),
    ("gru_hidden_dim", 0, "must be an integer >= 1"),
    ("emb_dim", 0, "must be an integer >= 1"),
    ("emb_dim", 2.5, "must be an integer >= 1"),
    ("projector_type", "linear", "must be 'domino'"),
    ("sample_from_anchor", True, "must be false for Domino"),
    ("output_multiplier", 2.0, "leave it at 1.0"),
])
def test_validation_refuses_what_sglang_refuses(field, value, message):
    with pytest.raises(ValueError, match=f"invalid {field}=.*{message}"):
        _config(**{field: value})


def test_walk_equals_the_teacher_forced_argmax_of_its_own_drafts():
    """Fed its own drafts as the gold prefix, the training logits' argmax is the walk."""
    drafter, changed = _drafter(), 0
    embed = torch.nn.Embedding(97, 48)
    lm_head = torch.nn.Linear(48, 97, bias=False)
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        hidden_bh, anchor = torch.randn(B, 48, generator=g), seed + 3
        base = lm_head(hidden_bh[1:])
        tokens = domino.domino_walk(drafter.prefix_gru, drafter.embed_proj, embed, hidden_bh[1:],
                                    base, anchor)
        prev = torch.cat([torch.tensor([anchor, anchor]), tokens[:-1]])
        with torch.no_grad():
            c = domino.correction_inputs(drafter, embed, hidden_bh[None, None], prev[None, None])
            final = lm_head(hidden_bh) + drafter.embed_proj[2](c[0, 0])
        assert torch.equal(final[1:].argmax(-1), tokens)
        assert not c[0, 0, :2].any()  # slots 0 and 1 keep the base logits
        changed += int(not torch.equal(tokens, base.argmax(-1)))
        for pool in (97, 500):  # a pool of the whole vocabulary is the exact walk
            assert torch.equal(domino.domino_walk(drafter.prefix_gru, drafter.embed_proj, embed,
                                                  hidden_bh[1:], base, anchor, pool), tokens)
        small = domino.domino_walk(drafter.prefix_gru, drafter.embed_proj, embed, hidden_bh[1:],
                                   base, anchor, 3)
        pool_ids = base[1:].amax(0).topk(3).indices
        assert small[0] == tokens[0] and bool(torch.isin(small[1:], pool_ids).all())
    assert changed  # the correction changed some draft: the test sees the GRU path


def test_draft_hook_point_mass_at_temperature_and_needs_the_embedding():
    drafter, embed = _drafter(), torch.nn.Embedding(97, 48)
    hidden, unary = torch.randn(B - 1, 48), torch.randn(B - 1, 97)
    tokens, q = drafter.config.head.draft(drafter, hidden, unary, 5, 0.8, "rejection", None,
                                          embed)
    assert torch.equal(q.argmax(-1), tokens) and torch.equal(q.sum(-1), torch.ones(B - 1))
    with pytest.raises(ValueError, match="target's embedding table"):
        drafter.config.head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None)


def test_evals_walk_setting_sets_the_candidate_pool_and_refuses_bad_ones():
    """``drafter.walk={candidate_pool_size: P}`` (dflash-eval) drafts as SGLang's pool P."""
    drafter, embed = _drafter(), torch.nn.Embedding(97, 48)
    head = drafter.config.head
    assert drafter.walk_settings == {"candidate_pool_size": 2048}  # SGLang's default
    hidden, unary = torch.randn(B - 1, 48), torch.randn(B - 1, 97)
    drafter.walk_settings = head.walk_with(drafter.config, {"candidate_pool_size": 3})
    tokens, _ = head.draft(drafter, hidden, unary, 5, 0.0, "exact_match", None, embed)
    assert torch.equal(tokens, domino.domino_walk(drafter.prefix_gru, drafter.embed_proj, embed,
                                                  hidden, unary, 5, 3))
    with pytest.raises(ValueError, match=r"drafter.walk.pool_size: the Domino walk takes "
                                         r"\['candidate_pool_size'\]"):
        head.walk_with(drafter.config, {"pool_size": 3})
    with pytest.raises(ValueError, match=r"candidate_pool_size=-1: give an integer >= 0"):
        head.walk_with(drafter.config, {"candidate_pool_size": -1})
    with pytest.raises(ValueError, match="the DFlash 1 walk takes no settings"):
        tiny_drafter_config().head.walk_with(None, {"candidate_pool_size": 3})


def test_lambda_schedule_is_specforges():
    assert domino.lambda_base(0, 100) == 1.0
    assert domino.lambda_base(25, 100) == 0.5
    assert domino.lambda_base(50, 100) == domino.lambda_base(90, 100) == 0.0
    assert domino.lambda_base(10, None) == 0.0  # no horizon: no base term (speculators)
    assert domino.lambda_base(10, float("inf")) == 0.0  # max_epochs=-1: Lightning's inf
    assert domino.lambda_base(5, 20, lambda_start=0.8, decay_ratio=1.0) == pytest.approx(0.6)


def _module(loss="ce", **settings):
    drafter = _drafter()
    drafter.train()
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(97, 48)
    head.lm_head = torch.nn.Linear(48, 97, bias=False)
    return DFlashModule(drafter, head, optimizer=torch.optim.SGD, gamma=4.0,
                        label_source="dataset", head=settings, loss=loss,
                        target_distribution={"last_hidden": True})


def test_one_training_step_mixes_final_and_base_ce(monkeypatch):
    module = _module(lambda_start=1.0, decay_ratio=0.5)
    g = torch.Generator().manual_seed(3)
    batch = {"hidden": torch.randn(2, 24, 3 * 48, generator=g),
             "input_ids": torch.randint(0, 90, (2, 24), generator=g),
             "loss_mask": torch.ones(2, 24)}
    anchors, valid = torch.tensor([[1, 8, 15]] * 2), torch.ones(2, 3, dtype=torch.bool)
    final = module.objective(module.blocks_loss(batch, anchors, valid), 0)  # no horizon: final
    hidden = module.draft(batch, anchors)
    out = module.loss(batch, hidden, anchors, valid)
    base = dflash_loss(hidden, _targets(module, batch, anchors, valid), module.target_head.lm_head,
                       4.0)
    base_ce = base.weighted_sum / base.weight_sum
    monkeypatch.setattr(domino, "lambda_base", lambda *a, **k: 0.3)
    mixed = module.objective(module.blocks_loss(batch, anchors, valid), 0)
    assert mixed.item() == pytest.approx(0.7 * final.item() + 0.3 * base_ce.item(), rel=1e-5)
    assert not torch.isclose(final, base_ce)  # the correction changes the loss
    mixed.backward()
    for name in ("prefix_gru.weight_ih_l0", "embed_proj.0.weight", "embed_proj.2.weight"):
        assert module.drafter.get_parameter(name).grad.abs().sum() > 0, name
    assert out.head_pieces["domino"][0] == 0.0  # before the patch: no horizon, no base term
    with pytest.raises(ValueError, match=r"module.head: \['alpha'\] are not settings of the "
                                         "Domino head"):
        _module(alpha=1.0)


@pytest.mark.parametrize("loss", [{"kl": 1.0}, {"ce": 0.1, "tv": 0.9}])
def test_a_distribution_loss_trains_the_correction_and_the_base_term(monkeypatch, loss):
    """module.loss beyond ce: L(final) on ConcatHead [W_lm | embed_proj.2] and L(base) on the
    target head; every correction tensor learns and a few SGD steps lower the loss."""
    monkeypatch.setattr(domino, "lambda_base", lambda *a, **k: 0.3)
    module = _module(loss)
    g = torch.Generator().manual_seed(3)
    batch = {"hidden": torch.randn(2, 24, 3 * 48, generator=g),
             "input_ids": torch.randint(0, 90, (2, 24), generator=g),
             "loss_mask": torch.ones(2, 24), "target_last_hidden": torch.randn(2, 24, 48,
                                                                             generator=g)}
    anchors, valid = torch.tensor([[1, 8, 15]] * 2), torch.ones(2, 3, dtype=torch.bool)
    opt = torch.optim.SGD(module.drafter.parameters(), lr=0.01)  # CE too diverges at 0.05
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out = module.blocks_loss(batch, anchors, valid)
        assert out.head_pieces["domino"][1].term_sums  # the base term is module.loss too
        value = module.objective(out, 0)
        value.backward()
        assert torch.isfinite(value)
        for name in ("prefix_gru.weight_ih_l0", "embed_proj.0.weight", "embed_proj.2.weight"):
            assert module.drafter.get_parameter(name).grad.abs().sum() > 0, name
        losses.append(value.item())
        opt.step()
    assert losses[-1] < losses[0]


def _targets(module, batch, anchors, valid):
    from dflash_lab.train.loss import block_targets

    cfg = module.drafter.config
    return block_targets(batch["input_ids"], batch["loss_mask"], anchors, valid, cfg.block_size,
                         None, cfg.label_shift)
