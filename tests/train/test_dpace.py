"""D-PACE slot weights (``module.position_weighting: dpace``): the formula on hand-computed
blocks, no gradient through the weights, the unary and selector terms, bad values refused, and a
training step that runs with them."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from dflash_lab.heads.dflash2 import selector_loss
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.checks import check_module
from dflash_lab.train.loss import block_targets, dpace_weights, slot_weights
from dflash_lab.train.module import DFlashModule
from dflash_lab.train.objective import dflash_loss
from tests.doubles import tiny_drafter_config
from tests.train.test_dflash2 import _hidden_and_targets
from tests.train.test_dflash2 import _module as _dflash2_module


def _ce(q):
    return torch.tensor([[[-math.log(x) for x in row] for row in q]])  # [1, N, B]


def test_dpace_weights_match_the_formula_on_hand_computed_blocks():
    valid = torch.tensor([[[False, True, True, True], [False, True, False, True]]])
    ce = _ce([[1.0, 0.5, 0.25, 1.0], [1.0, 0.5, 0.1, 0.5]])
    # block 0, alpha 0.5: s = 0.75, 0.625, 1.0; P = 0.75, 0.46875, 0.46875; w_t = sum_{j>=t} P_j
    # block 1: slot 2 invalid (s = 1, no term): P = 0.75, -, 0.5625
    want = torch.tensor([[[0.0, 1.6875, 0.9375, 0.46875], [0.0, 1.3125, 0.0, 0.5625]]])
    torch.testing.assert_close(dpace_weights(ce, valid, 0.5), want)
    # alpha 1: every s is 1, so w_t counts the valid slots at or after t (a linear decay)
    counts = torch.tensor([[[0.0, 3.0, 2.0, 1.0], [0.0, 2.0, 0.0, 1.0]]])
    torch.testing.assert_close(dpace_weights(ce, valid, 1.0), counts)
    torch.testing.assert_close(slot_weights(valid, ce[valid], 4.0, "dpace", 0.5), want[valid])


def test_dflash_loss_with_dpace_weights_its_own_ce_and_passes_no_gradient_through_them():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(1, 2, 4, 4, requires_grad=True)
    tgt = block_targets(torch.arange(12)[None] % 7, torch.ones(1, 12), torch.tensor([[1, 6]]),
                        torch.tensor([[True, True]]), 4)
    out = dflash_loss(hidden, tgt, head, 4.0, weighting="dpace", dpace_alpha=0.5)
    ce = torch.nn.functional.cross_entropy(head(hidden[0]).transpose(1, 2),
                                           tgt.labels[0], reduction="none")[None]  # [1, 2, 4]
    w = dpace_weights(ce.detach(), tgt.valid, 0.5)
    torch.testing.assert_close(out.weighted_sum, (w * ce)[tgt.valid].sum())
    torch.testing.assert_close(out.weight_sum, w.sum())
    assert not out.weight_sum.requires_grad
    (grad,) = torch.autograd.grad(out.weighted_sum, hidden)
    (want,) = torch.autograd.grad((w * ce)[tgt.valid].sum(), hidden)  # w a constant
    torch.testing.assert_close(grad, want)
    exp_decay = dflash_loss(hidden, tgt, head, 4.0)
    assert not torch.allclose(exp_decay.weight_sum, out.weight_sum)


def _head(cfg):
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return head


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"position_weighting": "adaptive"}, "module.position_weighting='adaptive'"),
    ({"position_weighting": "dpace", "dpace_alpha": 0.0}, "module.dpace_alpha=0.0"),
    ({"position_weighting": "dpace", "dpace_alpha": 1.5}, "module.dpace_alpha=1.5"),
])
def test_bad_weighting_values_are_refused_naming_the_key(kwargs, message):
    cfg = tiny_drafter_config("mixed_swa")
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        DFlashModule(DFlashDrafter(cfg), _head(cfg), optimizer=torch.optim.SGD, **kwargs)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_module(OmegaConf.create({"module": {"num_anchors": 4, "gamma": 4.0, **kwargs}}))
    # exp_decay ignores dpace_alpha (it is dpace's setting only)
    check_module(OmegaConf.create({"module": {"position_weighting": "exp_decay",
                                              "dpace_alpha": 0.0}}))


def test_a_training_step_runs_with_dpace_and_moves_the_drafter():
    cfg = tiny_drafter_config("mixed_swa")
    torch.manual_seed(0)
    module = DFlashModule(DFlashDrafter(cfg), _head(cfg), optimizer=torch.optim.SGD,
                          label_source="dataset", position_weighting="dpace", dpace_alpha=0.5)
    assert module.hparams.position_weighting == "dpace"
    g = torch.Generator().manual_seed(3)
    batch = {"hidden": torch.randn(2, 16, 3 * cfg.hidden_size, generator=g),
             "input_ids": torch.randint(0, 90, (2, 16), generator=g),
             "loss_mask": torch.ones(2, 16)}
    before = [p.detach().clone() for p in module.drafter.parameters()]
    opt = torch.optim.SGD(module.drafter.parameters(), lr=0.1)
    out = module.blocks_loss(batch, torch.tensor([[1, 7], [2, 9]]), torch.ones(2, 2).bool())
    loss = module.objective(out, step=0)
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    moved = [not torch.equal(a, p) for a, p in zip(before, module.drafter.parameters(),
                                                   strict=True)]
    assert any(moved)


@pytest.mark.parametrize("missing_gold", ["exclude", "swap"])
def test_dflash2_selector_term_uses_dpace_over_the_slots_it_trains(missing_gold):
    """alpha 1: each trained slot weighs the number of trained slots at or after it in its block
    (whatever the CE), so the selector's weight sum tells which slots the chain runs over."""
    module = _dflash2_module(selector={"missing_gold": missing_gold})
    hidden, tgt, anchor_ids, anchor_valid = _hidden_and_targets(module)
    cfg, lm_head = module.drafter.config, module.target_head.lm_head
    out = dflash_loss(hidden, tgt, lm_head, 2.0, block_valid_bn=anchor_valid,
                      top_k=cfg.selector_top_k, weighting="dpace", dpace_alpha=1.0)
    sel = out.head_pieces["selector"] = selector_loss(
        module.drafter.candidate_selector, hidden, out, tgt, anchor_ids, lm_head, 2.0,
        missing_gold, weighting="dpace", dpace_alpha=1.0)
    trained = tgt.valid & (sel.in_candidates if missing_gold == "exclude" else True)
    assert trained.sum() < tgt.valid.sum() or missing_gold == "swap"
    after = trained.flip(-1).cumsum(-1).flip(-1) * trained  # trained slots j >= t
    assert sel.weight_sum.item() == after.sum().item()
    unary_after = tgt.valid.flip(-1).cumsum(-1).flip(-1) * tgt.valid
    assert out.weight_sum.item() == unary_after.sum().item()
