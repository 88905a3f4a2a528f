"""The distribution losses (train/distill.py, train/distill_head.py): each loss and its gradient
against a naive full-logits autograd reference, the sparse (top-k + tail) teacher against a
naive bucketed one, mixes, chunking, the accept objective, the D-PACE confidence, the teacher's
alignment, the bounded memory, the config refusals, and speculators 0.9.0's own eager losses on
the same tensors (its venv)."""

import json
import math
import subprocess

import pytest
import torch
from torch import nn

from dflash_lab.train.distill import (
    DISTRIBUTION_LOSSES,
    LossSpec,
    Teacher,
    candidate_logprobs,
    expected_accepted,
    slot_teacher,
    teacher_kind,
)
from dflash_lab.train.distill_head import distill_buffers, distill_head_pass
from dflash_lab.train.loss import (
    BlockTargets,
    LogitScale,
    acceptance_lengths,
    chunked_head_pass,
    slot_weights,
)
from dflash_lab.train.objective import dflash_loss
from tests.train.test_loss import _LargestOutput
from tests.train.test_warm_start import SPEC_PYTHON

M, H, V = 29, 8, 61


def _case(seed: int = 0, m: int = M, v: int = V):
    torch.manual_seed(seed)
    head = nn.Linear(H, v, bias=False).requires_grad_(False)
    return head, torch.randn(m, H), torch.randn(m, H) * 2.0, torch.randint(0, v, (m,))


def naive_loss(name: str, z: torch.Tensor, t: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """Per-row loss [m] from full drafter logits ``z`` and target logits ``t`` [m, V], written
    out from the definitions (autograd gives the reference gradient)."""
    logq, logp = z.log_softmax(-1), t.log_softmax(-1)
    q, p = logq.exp(), logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if name == "kl":
        return kl
    if name == "rkl":
        return (q * (logq - logp)).sum(-1)
    if name == "jsd":
        m = 0.5 * (p + q)
        return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    if name == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if name == "nla":
        return -alpha.clamp(min=1e-5).log()
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


def _ours(spec, head, h, teacher, y, **kw):
    h = h.clone().requires_grad_(True)
    out = distill_head_pass(h, y, head, spec, teacher, **kw)
    return out, h


@pytest.mark.parametrize("name", DISTRIBUTION_LOSSES)
def test_each_loss_and_its_gradient_equal_the_naive_full_logits_reference(name):
    head, h, th, y = _case()
    weights = torch.rand(M)
    scale, cap, temp = LogitScale(1.3, 6.0), 5.0, 0.7  # drafter scale, target softcap, T_label
    spec = LossSpec.create({name: 1.0}, label_temperature=temp)
    out, h1 = _ours(spec, head, h, Teacher(th, softcap=cap), y,
                    chunk_size=8 * distill_buffers(spec, True), scale=scale)
    (weights * out.loss).sum().backward()
    h2 = h.clone().requires_grad_(True)
    t = torch.tanh((th @ head.weight.t()) / cap) * cap / temp
    ref = naive_loss(name, scale(h2 @ head.weight.t()), t)
    (weights * ref).sum().backward()
    torch.testing.assert_close(out.loss, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-7, rtol=1e-4)
    assert h1.grad.abs().max() > 1e-3  # a real gradient, not zeros on both sides


def test_the_mix_is_the_weighted_sum_of_its_terms_with_the_label_ce():
    head, h, th, y = _case(1)
    mix = LossSpec.create({"ce": 0.1, "tv": 0.9, "kl": 0.5})
    out, h1 = _ours(mix, head, h, Teacher(th), y, chunk_size=3)
    out.loss.sum().backward()
    h2 = h.clone().requires_grad_(True)
    z, t = h2 @ head.weight.t(), th @ head.weight.t()
    ce = nn.functional.cross_entropy(z, y, reduction="none")
    ref = 0.1 * ce + 0.9 * naive_loss("tv", z, t) + 0.5 * naive_loss("kl", z, t)
    ref.sum().backward()
    torch.testing.assert_close(out.loss, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-7, rtol=1e-4)
    torch.testing.assert_close(out.ce, ce.detach(), atol=2e-6, rtol=1e-5)
    assert out.terms.shape == (2, M)  # tv, kl (ce is out.ce)


def test_the_unary_top_k_equals_the_ce_pass_s():
    head, h, th, y = _case(9)
    scale = LogitScale(1.0, 4.0)
    ours, _ = _ours(LossSpec.create("kl"), head, h, Teacher(th), y, chunk_size=24, top_k=4,
                    scale=scale)
    ce = chunked_head_pass(h, y, head, chunk_size=5, scale=scale, top_k=4)
    torch.testing.assert_close(ours.top_values, ce.top_values)
    assert torch.equal(ours.top_ids, ce.top_ids) and ours.top_ids.shape == (M, 4)
    torch.testing.assert_close(ours.ce, ce.ce)
    assert torch.equal(ours.correct, ce.correct)


def test_results_do_not_depend_on_the_chunking():
    head, h, th, y = _case(2)
    spec = LossSpec.create({"jsd": 1.0, "accept": 0.5})
    buffers = distill_buffers(spec, True)
    runs = [_ours(spec, head, h, Teacher(th), y, chunk_size=c, temperatures=(1.0, 0.5))
            for c in (buffers, 7 * buffers, 10**6)]
    for out, _ in runs:
        (out.loss.sum() + out.accept.sum()).backward()
    first, h_first = runs[0]
    for out, hh in runs[1:]:
        torch.testing.assert_close(out.loss, first.loss)
        torch.testing.assert_close(out.overlaps, first.overlaps)
        torch.testing.assert_close(hh.grad, h_first.grad)


def naive_bucket_loss(name: str, z: torch.Tensor, ids: torch.Tensor, logp_k: torch.Tensor):
    """The loss over K + 1 buckets (the teacher's top-k ids and the tail), from full logits."""
    q = z.softmax(-1)
    p_k = logp_k.exp()
    p = torch.cat([p_k, (1 - p_k.sum(-1, keepdim=True)).clamp(min=0)], -1)
    q_k = q.gather(-1, ids)
    qb = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1)
    if name == "kl":
        return (p * (p.log() - qb.log())).sum(-1)
    if name == "rkl":
        return (qb * (qb.log() - p.log())).sum(-1)
    if name == "tv":
        return 0.5 * (p - qb).abs().sum(-1)
    return -torch.minimum(p, qb).sum(-1).clamp(min=1e-5).log()  # nla


@pytest.mark.parametrize("name", ["kl", "rkl", "tv", "nla"])
def test_a_topk_teacher_is_a_distribution_over_its_ids_and_the_tail(name):
    head, h, th, y = _case(3)
    logp_k, ids = (th @ head.weight.t()).log_softmax(-1).topk(6, dim=-1)
    out, h1 = _ours(LossSpec.create(name), head, h, Teacher(None, ids, logp_k), y, chunk_size=16)
    out.loss.sum().backward()
    h2 = h.clone().requires_grad_(True)
    ref = naive_bucket_loss(name, h2 @ head.weight.t(), ids, logp_k)
    ref.sum().backward()
    torch.testing.assert_close(out.loss, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-7, rtol=1e-4)
    if name == "kl":  # coarse-graining lowers KL (data processing inequality)
        full = naive_loss("kl", h @ head.weight.t(), th @ head.weight.t())
        assert (out.loss.detach() <= full + 1e-6).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_the_accept_objective_is_minus_the_expected_accepted_drafts_with_its_gradient(
        temperature):
    head, _, _, _ = _case(4)
    bt, n, b = 2, 3, 5
    hidden = torch.randn(bt, n, b, H, requires_grad=True)
    labels = torch.randint(0, V, (bt, n, b))
    valid = torch.rand(bt, n, b) > 0.15
    valid[..., 0] = False
    blocks = torch.tensor([[True, True, False], [True, True, True]])
    teacher_h = torch.randn(int(valid.sum()), H) * 2
    spec = LossSpec.create("accept", accept_temperature=temperature)
    out = dflash_loss(hidden, BlockTargets(labels, valid), head, 4.0, block_valid_bn=blocks,
                      spec=spec, teacher=Teacher(teacher_h))
    out.accept_sum.backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    z = hidden[valid] @ head.weight.t()
    if temperature == 0:  # the smooth greedy surrogate: the drafter's probability of the label
        alpha = z.softmax(-1).gather(-1, labels[valid][:, None])[:, 0]
    else:
        p = ((teacher_h @ head.weight.t()) / temperature).softmax(-1)
        alpha = torch.minimum((z / temperature).softmax(-1), p).sum(-1)
    a = torch.zeros(bt, n, b).masked_scatter(valid, alpha)
    chained = torch.where(valid, a, torch.zeros_like(a))[..., 1:].cumprod(-1).sum(-1)[blocks]
    (-chained.sum()).backward()
    torch.testing.assert_close(out.accept_sum, -chained.sum())
    torch.testing.assert_close(ours, hidden.grad, atol=1e-7, rtol=1e-4)
    assert out.accept_count.item() == int(blocks.sum())


def test_expected_acceptance_at_certain_slots_is_the_greedy_count():
    correct = torch.tensor([[[False, True, True, False, True], [False, False, True, True, True]]])
    valid = torch.ones_like(correct)
    valid[..., 0] = False
    blocks = torch.ones(1, 2, dtype=torch.bool)
    expected = 1 + expected_accepted(correct.float(), valid, blocks)
    assert expected.tolist() == acceptance_lengths(correct, blocks).tolist() == [3.0, 1.0]


def test_val_overlaps_are_exact_acceptance_probabilities():
    head, h, th, y = _case(5)
    spec = LossSpec.create("kl")
    with torch.no_grad():
        out = distill_head_pass(h, y, head, spec, Teacher(th), temperatures=(0.0, 1.0, 2.0))
    z, t = h @ head.weight.t(), th @ head.weight.t()
    assert out.overlaps[0].tolist() == (z.argmax(-1) == t.argmax(-1)).float().tolist()
    for i, temp in ((1, 1.0), (2, 2.0)):
        ref = torch.minimum((z / temp).softmax(-1), (t / temp).softmax(-1)).sum(-1)
        torch.testing.assert_close(out.overlaps[i], ref)
    torch.testing.assert_close(out.overlap, out.overlaps[1])  # T_label = 1


def test_dpace_weights_of_a_distribution_loss_come_from_the_overlap():
    head, _, _, _ = _case(6)
    bt, n, b = 1, 2, 4
    hidden = torch.randn(bt, n, b, H)
    labels = torch.randint(0, V, (bt, n, b))
    valid = torch.ones(bt, n, b, dtype=torch.bool)
    valid[..., 0] = False
    th = torch.randn(int(valid.sum()), H)
    out = dflash_loss(hidden, BlockTargets(labels, valid), head, 4.0, weighting="dpace",
                      spec=LossSpec.create("tv"), teacher=Teacher(th))
    z, t = hidden[valid] @ head.weight.t(), th @ head.weight.t()
    alpha = torch.minimum(z.softmax(-1), t.softmax(-1)).sum(-1)
    tv = 1 - alpha
    w = slot_weights(valid, -alpha.log(), 4.0, "dpace", 0.5)
    torch.testing.assert_close(out.weighted_sum, (w * tv).sum(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.weight_sum, w.sum())


def test_the_teacher_of_slot_t_is_the_target_output_before_its_position():
    last = torch.arange(2 * 9, dtype=torch.float32).view(2, 9, 1).expand(2, 9, 3)
    anchors = torch.tensor([[2, 5], [0, 4]])
    valid = torch.ones(2, 2, 3, dtype=torch.bool)
    valid[..., 0] = False
    teacher = slot_teacher("dense", {"target_last_hidden": last}, anchors, valid, None)
    # slot t of the block at a: position a + t, predicted from the target's output at a + t - 1
    assert teacher.hidden_mh[:, 0].tolist() == [2, 3, 5, 6, 9, 10, 13, 14]


def test_no_chunk_holds_more_than_the_ce_pass_would():
    head, h, th, y = _case(7, m=64, v=997)
    spec = LossSpec.create({"kl": 1.0, "accept": 1.0})
    budget = 40 * V * 4
    probe = _LargestOutput()
    with probe:
        out, hh = _ours(spec, head, h, Teacher(th), y, chunk_bytes=budget)
        (out.loss.sum() + out.accept.sum()).backward()
    ce_rows = budget // (997 * 4)
    rows = max(1, ce_rows // distill_buffers(spec, True))
    assert probe.max_bytes <= rows * 997 * 4 + 1024
    assert probe.max_bytes < 64 * 997 * 4 // 2  # never [M, V]


def test_loss_spec_refusals_name_the_key():
    with pytest.raises(ValueError, match="unknown loss 'kl_div'.*did you mean 'kl'"):
        LossSpec.create({"kl_div": 1.0})  # speculators' name
    with pytest.raises(ValueError, match="unknown loss 'jds'.*did you mean 'jsd'"):
        LossSpec.create("jds")
    with pytest.raises(ValueError, match=r"module.loss.tv=-1"):
        LossSpec.create({"tv": -1})
    with pytest.raises(ValueError, match="every weight is 0"):
        LossSpec.create({"kl": 0})
    with pytest.raises(ValueError, match="module.label_temperature=0"):
        LossSpec.create("kl", label_temperature=0)
    assert LossSpec.create("ce").ce_only and not LossSpec.create("ce").needs_distribution
    assert not LossSpec.create("accept", accept_temperature=0).needs_distribution


def test_teacher_kind_refuses_what_the_data_cannot_give():
    kl = LossSpec.create("kl")
    assert teacher_kind(LossSpec(), None, (), "x") == "none"
    assert teacher_kind(kl, {"last_hidden": True, "topk": 8}, (2.0,), "x") == "dense"
    assert teacher_kind(kl, {"last_hidden": False, "topk": 8}, (1.0,), "x") == "sparse"
    with pytest.raises(ValueError, match=r"capture.distribution=\[last_hidden\]"):
        teacher_kind(kl, {"last_hidden": False, "topk": 0}, (), "the capture C")
    with pytest.raises(ValueError, match="top-k at T = 1 only"):
        teacher_kind(LossSpec.create("kl", label_temperature=2.0), {"topk": 8}, (), "C")
    with pytest.raises(ValueError, match="module.val_temperatures"):
        teacher_kind(LossSpec(), {"topk": 0}, (1.0,), "C")


def test_candidate_logprobs_of_dense_and_topk_teachers():
    head, _, th, _ = _case(10)
    ids = torch.randint(0, V, (M, 3))
    t = th @ head.weight.t()
    full = (t / 0.5).log_softmax(-1).gather(-1, ids)
    torch.testing.assert_close(candidate_logprobs(Teacher(th), ids, head, 0.5, False), full)
    torch.testing.assert_close(candidate_logprobs(Teacher(th), ids, head, 0.5),
                               full.log_softmax(-1))  # renormalised over the K
    logp_k, top = t.log_softmax(-1).topk(5, dim=-1)
    ids[:, 0] = top[:, 2]  # one candidate in the top-k, the others (mostly) in the tail
    got = candidate_logprobs(Teacher(None, top, logp_k), ids, head, renormalise=False)
    torch.testing.assert_close(got[:, 0], logp_k[:, 2])
    tail = (1 - logp_k.exp().sum(-1)) / (V - 5)
    outside = ~(ids[:, 1:, None] == top[:, None]).any(-1)
    torch.testing.assert_close(got[:, 1:][outside], tail[:, None].expand(-1, 2)[outside].log())


# ------------------------------------------------------------------- speculators' own losses
_SPEC_LOSSES = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from speculators.losses import eager
t = load_file(sys.argv[1] + "/in.safetensors")
fns = {"kl": eager.kl_div_loss, "rkl": eager.reverse_kl_div_loss, "jsd": eager.js_div_loss,
       "tv": eager.tv_loss, "nla": eager.neg_log_acceptance_loss,
       "lk_hybrid": eager.lk_hybrid_loss, "ce": eager.ce_loss}
out = {}
for name, fn in fns.items():
    z = t["z"][None].clone().requires_grad_(True)
    value = fn(z, t["t"][None])[0]
    (value * t["w"]).sum().backward()
    out[name] = value.detach()
    out[name + "_grad"] = z.grad[0]
save_file(out, sys.argv[1] + "/out.safetensors")
"""


@pytest.mark.skipif(not SPEC_PYTHON.exists(),
                    reason="needs speculators 0.9.0 in .venv-speculators (make speculators-venv)")
def test_every_loss_equals_speculators_eager_loss_on_the_same_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    head, h, th, y = _case(8)
    z, t = (h @ head.weight.t()).float(), (th @ head.weight.t()).float()
    w = torch.rand(M)
    y = t.argmax(-1)  # their ce labels the argmax of the verifier logits
    save_file({"z": z, "t": t, "w": w}, str(tmp_path / "in.safetensors"))
    (tmp_path / "peer.py").write_text(_SPEC_LOSSES)
    done = subprocess.run([str(SPEC_PYTHON), str(tmp_path / "peer.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = load_file(str(tmp_path / "out.safetensors"))
    for name in (*DISTRIBUTION_LOSSES, "ce"):
        out, h1 = _ours(LossSpec.create(name), head, h, Teacher(th), y)
        (w * out.loss).sum().backward()
        torch.testing.assert_close(out.loss, theirs[name], atol=2e-6, rtol=1e-5, msg=name)
        # their gradient is in the logits: ours in the hidden states is that times the head
        torch.testing.assert_close(h1.grad, theirs[name + "_grad"] @ head.weight, atol=2e-7,
                                   rtol=1e-4, msg=name)
    assert json.dumps(sorted(theirs))  # every loss ran
    assert math.isfinite(float(theirs["nla"].sum()))


def test_a_dense_mix_with_accept_softcap_and_temperatures_equals_the_naive_reference():
    head, h, th, y = _case(10)
    scale = LogitScale(1.3, 6.0)
    spec = LossSpec.create({"ce": 0.2, "lk_hybrid": 1.0, "accept": 0.5}, label_temperature=0.8,
                           accept_temperature=0.6)
    out, h1 = _ours(spec, head, h, Teacher(th, softcap=5.0), y, chunk_size=11, scale=scale,
                    temperatures=(0.0, 0.6, 1.0))
    (out.loss.sum() + 0.5 * out.accept.sum()).backward()
    h2 = h.clone().requires_grad_(True)
    z, t = scale(h2 @ head.weight.t()), 5.0 * torch.tanh((th @ head.weight.t()) / 5.0)

    def alpha(zz, temp=0.6):
        return torch.minimum((zz / temp).softmax(-1), (t / temp).softmax(-1)).sum(-1)

    ce = nn.functional.cross_entropy(z, y, reduction="none")
    ref = 0.2 * ce + naive_loss("lk_hybrid", z, t / 0.8)
    (ref.sum() + 0.5 * alpha(z).sum()).backward()
    torch.testing.assert_close(out.loss, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.accept, alpha(z), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-7, rtol=1e-4)
    zd = z.detach()
    assert out.overlaps[0].tolist() == (zd.argmax(-1) == t.argmax(-1)).float().tolist()
    torch.testing.assert_close(out.overlaps[1], alpha(zd))
    torch.testing.assert_close(out.overlaps[2], alpha(zd, 1.0))


@pytest.mark.parametrize("accept_temperature", [0.0, 1.0])
def test_a_topk_mix_with_accept_and_softcap_equals_the_naive_bucket_reference(
        accept_temperature):
    head, h, th, y = _case(11)
    scale = LogitScale(1.3, 6.0)
    logp_k, ids = (th @ head.weight.t()).log_softmax(-1).topk(6, dim=-1)
    spec = LossSpec.create({"ce": 0.3, "kl": 0.7, "accept": 0.5},
                           accept_temperature=accept_temperature)
    out, h1 = _ours(spec, head, h, Teacher(None, ids, logp_k), y, chunk_size=10, scale=scale,
                    temperatures=(0.0, 1.0))
    (out.loss.sum() + 0.5 * out.accept.sum()).backward()
    h2 = h.clone().requires_grad_(True)
    z = scale(h2 @ head.weight.t())
    q = z.softmax(-1)
    p_k = logp_k.exp()
    p = torch.cat([p_k, (1 - p_k.sum(-1, keepdim=True)).clamp(min=0)], -1)
    qb = torch.cat([q.gather(-1, ids), 1 - q.gather(-1, ids).sum(-1, keepdim=True)], -1)
    overlap = torch.minimum(p, qb).sum(-1)
    alpha = overlap if accept_temperature else q.gather(-1, y[:, None])[:, 0]
    ref = (0.3 * nn.functional.cross_entropy(z, y, reduction="none")
           + 0.7 * naive_bucket_loss("kl", z, ids, logp_k))
    (ref.sum() + 0.5 * alpha.sum()).backward()
    torch.testing.assert_close(out.loss, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.accept, alpha, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=2e-7, rtol=1e-4)
    assert out.overlaps[0].tolist() == (z.argmax(-1) == ids[:, 0]).float().tolist()
    torch.testing.assert_close(out.overlaps[1], overlap.detach())
