"""The distribution pass on a head with trainable columns (DSpark's, Domino's and XPress's
:class:`~dflash_lab.heads.dspark.ConcatHead`, ``[W_lm | w2]`` over ``[h; f]``): the gradients of
the hidden states AND of w2 equal a naive full-logits autograd reference (the teacher reads the
target's columns only), chunked and with non-uniform incoming row weights; the frozen head's
path recomputes nothing; a head the pass cannot read is refused by name."""

import pytest
import torch
from torch import nn

from dflash_lab.heads.dspark import ConcatHead
from dflash_lab.train import distill_head
from dflash_lab.train.distill import LossSpec, Teacher
from dflash_lab.train.distill_head import distill_head_pass
from dflash_lab.train.loss import LogitScale
from tests.train.test_distill import naive_bucket_loss, naive_loss

M, H, R, V = 29, 8, 3, 61


def _case(seed: int):
    """A frozen W_lm [V, H], a trainable w2 [V, R], inputs [h; f] [M, H + R], the teacher's
    hidden states [M, H], labels [M] and the incoming per-row weights of loss and accept."""
    torch.manual_seed(seed)
    lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
    w2 = nn.Linear(R, V, bias=False)
    with torch.no_grad():
        w2.weight.normal_(std=0.5)
    x = torch.randn(M, H + R)
    return lm_head, w2, x, torch.randn(M, H) * 2.0, torch.randint(0, V, (M,)), torch.rand(M), \
        torch.rand(M)


def _reference(spec, lm_head, w2, x, teacher_h, y, scale, softcap, sparse=None):
    """Per-row loss and accept [M] from full [M, V] logits of ``[W_lm | w2]`` (autograd)."""
    z = scale(x @ torch.cat([lm_head.weight, w2.weight], 1).t())
    t = lm_head(teacher_h)  # the target's own columns only
    t = t if softcap is None else softcap * torch.tanh(t / softcap)
    ce = nn.functional.cross_entropy(z, y, reduction="none")
    terms = dict(spec.slot_terms)
    loss = terms.get("ce", 0.0) * ce
    for name, weight in terms.items():
        if name != "ce":
            loss = loss + weight * (naive_loss(name, z, t / spec.label_temperature)
                                    if sparse is None else naive_bucket_loss(name, z, *sparse))
    tau = spec.accept_temperature
    if not spec.accept_weight:
        return loss, None
    if tau == 0:
        return loss, z.softmax(-1).gather(-1, y[:, None])[:, 0]
    if sparse is not None:
        q = z.softmax(-1)
        p_k = sparse[1].exp()
        p = torch.cat([p_k, (1 - p_k.sum(-1, keepdim=True)).clamp(min=0)], -1)
        qb = torch.cat([q.gather(-1, sparse[0]), 1 - q.gather(-1, sparse[0]).sum(-1,
                                                                              keepdim=True)], -1)
        return loss, torch.minimum(p, qb).sum(-1)
    return loss, torch.minimum((z / tau).softmax(-1), (t / tau).softmax(-1)).sum(-1)


SPECS = [
    ({"kl": 1.0}, {}),
    ({"ce": 0.1, "tv": 0.9}, {}),
    ({"ce": 0.2, "lk_hybrid": 1.0, "accept": 0.5}, {"label_temperature": 0.8,
                                                     "accept_temperature": 0.6}),
    ({"jsd": 0.7, "nla": 0.3, "accept": 1.0}, {"accept_temperature": 0.0}),
]


@pytest.mark.parametrize("loss, knobs", SPECS)
@pytest.mark.parametrize("scaled", [False, True])
def test_hidden_and_w2_gradients_equal_the_naive_reference(loss, knobs, scaled):
    lm_head, w2, x, teacher_h, y, wl, wa = _case(len(loss))
    spec = LossSpec.create(loss, **knobs)
    scale, softcap = (LogitScale(1.3, 6.0), 5.0) if scaled else (LogitScale(), None)
    x1 = x.clone().requires_grad_(True)
    out = distill_head_pass(x1, y, ConcatHead(lm_head, w2), spec,
                            Teacher(teacher_h, softcap=softcap), chunk_size=7, scale=scale)
    ours = (wl * out.loss).sum() + (0.0 if out.accept is None else (wa * out.accept).sum())
    ours.backward()
    ours_w2, w2.weight.grad = w2.weight.grad, None
    x2 = x.clone().requires_grad_(True)
    loss_m, accept_m = _reference(spec, lm_head, w2, x2, teacher_h, y, scale, softcap)
    ((wl * loss_m).sum() + (0.0 if accept_m is None else (wa * accept_m).sum())).backward()
    torch.testing.assert_close(out.loss, loss_m, atol=2e-6, rtol=1e-5)
    if accept_m is not None:
        torch.testing.assert_close(out.accept, accept_m, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-7, rtol=1e-4)
    torch.testing.assert_close(ours_w2, w2.weight.grad, atol=2e-7, rtol=1e-4)
    assert ours_w2.abs().max() > 1e-3 and x1.grad.abs().max() > 1e-3
    assert lm_head.weight.grad is None  # frozen: no gradient kept


def test_a_topk_teacher_trains_w2_as_the_naive_bucket_reference():
    lm_head, w2, x, teacher_h, y, wl, wa = _case(5)
    logp_k, ids = lm_head(teacher_h).log_softmax(-1).topk(6, dim=-1)
    spec = LossSpec.create({"ce": 0.3, "kl": 0.7, "accept": 0.5})
    x1 = x.clone().requires_grad_(True)
    out = distill_head_pass(x1, y, ConcatHead(lm_head, w2), spec, Teacher(None, ids, logp_k),
                            chunk_size=10)
    ((wl * out.loss).sum() + (wa * out.accept).sum()).backward()
    ours_w2, w2.weight.grad = w2.weight.grad, None
    x2 = x.clone().requires_grad_(True)
    loss_m, accept_m = _reference(spec, lm_head, w2, x2, teacher_h, y, LogitScale(), None,
                                  sparse=(ids, logp_k))
    ((wl * loss_m).sum() + (wa * accept_m).sum()).backward()
    torch.testing.assert_close(out.loss, loss_m, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-7, rtol=1e-4)
    torch.testing.assert_close(ours_w2, w2.weight.grad, atol=2e-7, rtol=1e-4)


def test_the_frozen_head_recomputes_nothing_and_a_biased_head_is_refused(monkeypatch):
    lm_head, _, x, teacher_h, y, _, _ = _case(6)

    def boom(*args):
        raise AssertionError("a frozen head's backward recomputed the chunks")

    monkeypatch.setattr(distill_head, "_weight_grad", boom)
    h = x[:, :H].clone().requires_grad_(True)
    distill_head_pass(h, y, lm_head, LossSpec.create("kl"), Teacher(teacher_h),
                      chunk_size=7).loss.sum().backward()
    assert h.grad.abs().max() > 0
    biased = nn.Linear(H, V)
    with pytest.raises(ValueError, match=r"module.loss=\{kl: 1\}.*bias-free linear LM head.*"
                                         r"got Linear; use module.loss=ce"):
        distill_head_pass(h, y, biased, LossSpec.create("kl"), Teacher(teacher_h))
    with pytest.raises(ValueError, match="got Embedding"):
        distill_head_pass(h, y, nn.Embedding(V, H), LossSpec.create("kl"), Teacher(teacher_h))


def test_validation_reads_a_concat_head_built_without_grad():
    """Under no_grad (validation) ConcatHead's weight requires no grad: still read, no grad."""
    lm_head, w2, x, teacher_h, y, _, _ = _case(7)
    with torch.no_grad():
        head = ConcatHead(lm_head, w2)
        out = distill_head_pass(x, y, head, LossSpec.create("kl"), Teacher(teacher_h),
                                temperatures=(1.0,))
    ref, _ = _reference(LossSpec.create("kl"), lm_head, w2, x, teacher_h, y, LogitScale(), None)
    torch.testing.assert_close(out.loss, ref.detach(), atol=2e-6, rtol=1e-5)


def test_w2_learns_when_the_hidden_states_need_no_gradient():
    """A detached input (features only) still trains the head's trainable columns."""
    lm_head, w2, x, teacher_h, y, wl, _ = _case(8)
    out = distill_head_pass(x, y, ConcatHead(lm_head, w2), LossSpec.create("kl"),
                            Teacher(teacher_h), chunk_size=7)
    (wl * out.loss).sum().backward()
    ours, w2.weight.grad = w2.weight.grad, None
    ref, _ = _reference(LossSpec.create("kl"), lm_head, w2, x, teacher_h, y, LogitScale(), None)
    (wl * ref).sum().backward()
    torch.testing.assert_close(ours, w2.weight.grad, atol=2e-7, rtol=1e-4)
