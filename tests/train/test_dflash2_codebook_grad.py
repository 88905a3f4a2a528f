"""DFlash 2 codebook gradients kept between steps (benchmark 2b): the same numbers, bitwise.

``DFlashModule.optimizer_zero_grad`` zeroes the two [V, R] codebook gradients in place instead
of dropping them; the next backward adds the looked-up rows into them as a sparse gradient
(``heads/dflash2._CodebookLookup``). These tests pin that this changes nothing: the gradient,
the parameters after several AdamW steps, a gradient accumulated over two backwards, and the
fused head pass's column max taken from its top-K all equal the plain path bit for bit.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.nn.functional as F

from dflash_lab.heads import dflash2
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import step_generator
from dflash_lab.train.loss import chunked_head_pass
from dflash_lab.train.module import DFlashModule
from tests.doubles import tiny_drafter_config

#: H=48 -> 3 conv groups of 16; rank 8 over the top 5 of a 97-token vocabulary: the 4 x 8
#: scored slots look up ~40 rows each step, so ids repeat (duplicates sum in one row).
V2 = {"variant": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
      "selector_top_k": 5}


def _plain_lookup(self, name, ids):
    """The lookup before the change: F.embedding (dense [V, R] gradient every backward)."""
    return F.embedding(ids, getattr(self, name))


def _module(variant=V2):
    cfg = tiny_drafter_config(**variant)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    if cfg.variant == "dflash2":  # a trained-looking selector: every codebook row gets a gradient
        with torch.no_grad():
            drafter.candidate_selector.successor_codebook.normal_(std=1.0)
    torch.manual_seed(1)
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    selector = {"missing_gold": "swap"} if cfg.variant == "dflash2" else None
    return DFlashModule(drafter, head, optimizer=torch.optim.AdamW, gamma=2.0, num_anchors=8,
                        label_source="dataset", selector=selector)


def _batch(cfg, seq=40, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {"hidden": torch.randn(2, seq, 3 * cfg.hidden_size, generator=g),
            "input_ids": torch.randint(0, cfg.vocab_size - 1, (2, seq), generator=g),
            "loss_mask": torch.ones(2, seq, dtype=torch.long)}


def _loss(module, batch, step):
    out = module.blocks_loss(batch, *module.sample_anchors(batch, step_generator(0, step)))
    return module.objective(out, step)


def _train(kept: bool, steps: int = 4, accumulate: int = 1):
    """Parameters after ``steps`` AdamW steps (``accumulate`` backwards each) and the
    successor codebook's gradient after each step (all held, so none is freed and reused)."""
    module = _module()
    opt = torch.optim.AdamW(module.drafter.parameters(), lr=1e-2)
    batch = _batch(module.drafter.config)
    grads = []
    for step in range(steps):
        for micro in range(accumulate):
            _loss(module, batch, step * accumulate + micro).backward()
        grads.append(module.drafter.candidate_selector.successor_codebook.grad)
        opt.step()
        if kept:
            module.optimizer_zero_grad(0, step, opt)
        else:
            opt.zero_grad(set_to_none=True)
    return ({k: v.detach().clone() for k, v in module.drafter.state_dict().items()},
            [g.data_ptr() for g in grads])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_kept_codebook_grads_train_bitwise_like_the_plain_path(monkeypatch, accumulate):
    taken = []
    take = dflash2._ZeroedGrad.take
    monkeypatch.setattr(dflash2._ZeroedGrad, "take",
                        lambda self, weight: taken.append(take(self, weight)) or taken[-1])
    new, new_addresses = _train(kept=True, accumulate=accumulate)
    # the sparse path ran: once per codebook and step after the first, then dense per micro
    assert taken == ([False] * 2 * accumulate
                     + ([True, True] + [False] * 2 * (accumulate - 1)) * 3)
    with monkeypatch.context() as m:
        m.setattr(dflash2.CandidateSelector, "_lookup", _plain_lookup)
        old, old_addresses = _train(kept=False, accumulate=accumulate)
    start = _module().drafter.state_dict()
    assert not torch.equal(new["candidate_selector.predecessor_codebook"],
                           start["candidate_selector.predecessor_codebook"])  # it trained
    differ = [k for k in old if not torch.equal(old[k], new[k])]
    assert differ == []
    # every backward wrote into the buffer kept from the first step; the plain path maps a
    # fresh one each step
    assert len(set(new_addresses)) == 1 and len(set(old_addresses)) == len(old_addresses)


def test_the_sparse_rows_sum_to_the_dense_embedding_gradient_bitwise():
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 16, generator=g))
    ids = torch.randint(0, 20, (64, 5), generator=g)  # every id repeats ~16 times
    upstream = torch.randn(64, 5, 16, generator=g)
    (F.embedding(ids, weight) * upstream).sum().backward()
    dense = weight.grad.clone()
    state = dflash2._ZeroedGrad()
    weight.grad.zero_()
    state.zeroed = True
    (dflash2._CodebookLookup.apply(ids, weight, state) * upstream).sum().backward()
    assert torch.equal(weight.grad, dense)
    assert not state.zeroed  # consumed: the next backward takes the dense path
    (dflash2._CodebookLookup.apply(ids, weight, state) * upstream).sum().backward()
    assert torch.equal(weight.grad, dense + dense)


def test_zero_grad_keeps_only_the_codebook_buffers_and_dflash1_sets_all_to_none():
    for variant in (V2, {}):
        module = _module(variant)
        opt = torch.optim.AdamW(module.drafter.parameters())
        _loss(module, _batch(module.drafter.config), 0).backward()
        module.optimizer_zero_grad(0, 0, opt)
        kept = {n for n, p in module.drafter.named_parameters() if p.grad is not None}
        if variant:
            assert kept == {"candidate_selector.predecessor_codebook",
                            "candidate_selector.successor_codebook"}
            for name in kept:
                assert module.drafter.get_parameter(name).grad.abs().sum() == 0
        else:
            assert kept == set()


def test_head_pass_column_max_from_the_top_k_leaves_the_loss_bitwise_unchanged():
    g = torch.Generator().manual_seed(3)
    # frozen (the fused pass) with 64 blocks of 64 entries: the blocked top-K path
    head = torch.nn.Linear(32, 4096, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(4096, 32, generator=g))
    hidden = torch.randn(50, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 4096, (50,), generator=g)
    plain = chunked_head_pass(hidden, labels, head, chunk_size=16)
    with_top = chunked_head_pass(hidden, labels, head, chunk_size=16, top_k=3)
    assert torch.equal(plain.ce, with_top.ce)
    assert torch.equal(plain.correct, with_top.correct)
    (grad_plain,) = torch.autograd.grad(plain.ce.sum(), hidden)
    (grad_top,) = torch.autograd.grad(with_top.ce.sum(), hidden)
    assert torch.equal(grad_plain, grad_top)


# ----------------------------------------------------------------------------- DDP
class _Objective(torch.nn.Module):
    """The module's step objective as a forward, so torch DDP wraps the drafter's parameters
    and all-reduces their gradients after each backward, as Lightning's DDP strategy does."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch, step):
        return _loss(self.module, batch, step)


def _ddp_train(rank: int, world: int, port: int, kept: bool, result_file: str) -> None:
    """3 AdamW steps under torch DDP (gloo), each rank on its own batch; rank 0 saves the
    parameters. ``kept``: zero grads through the module (sparse codebook rows) or to None.

    The ranks meet at a barrier once rank 0 has saved and then leave with ``os._exit(0)``, not
    through ``destroy_process_group``: in a full-suite run a rank once waited forever in that
    teardown after rank 0, which hosts the store, had gone (the result already saved)."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    module = _module()
    model = torch.nn.parallel.DistributedDataParallel(_Objective(module))
    opt = torch.optim.AdamW(module.drafter.parameters(), lr=1e-2)
    batch = _batch(module.drafter.config, seed=2 + rank)
    sparse_steps, take = [], dflash2._ZeroedGrad.take

    def counted_take(self, weight):
        sparse_steps.append(take(self, weight))
        return sparse_steps[-1]

    dflash2._ZeroedGrad.take = counted_take  # this spawned process only
    for step in range(3):
        model(batch, step).backward()
        opt.step()
        if kept:
            module.optimizer_zero_grad(0, step, opt)
        else:
            opt.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save({"params": {k: v.detach().clone()
                               for k, v in module.drafter.state_dict().items()},
                    "sparse": sum(sparse_steps)}, result_file)
    torch.distributed.barrier()
    os._exit(0)  # no teardown of the process group (see the docstring); the result is saved


def _spawn_bounded(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """``torch.multiprocessing.spawn`` that fails (and kills the ranks) after ``seconds``
    instead of waiting forever on a stuck rank."""
    context = torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"DDP ranks still running after {seconds} s: killed")


@pytest.mark.slow
def test_kept_codebook_grads_under_ddp_train_bitwise_like_the_plain_path(tmp_path):
    """Two DDP processes: the kept-buffer path (sparse rows added into a zeroed dense buffer,
    then DDP's all-reduce of that buffer) ends at the plain path's parameters, bit for bit."""
    results = {}
    for kept, port in ((False, 29541), (True, 29542)):
        result = str(tmp_path / f"kept{kept}.pt")
        _spawn_bounded(_ddp_train, (2, port, kept, result), nprocs=2, seconds=300)
        results[kept] = torch.load(result, weights_only=True)
    # steps 2 and 3, both codebooks: the sparse rows were added into the kept buffers
    assert results[True]["sparse"] == 4 and results[False]["sparse"] == 0
    results = {kept: r["params"] for kept, r in results.items()}
    assert results[True].keys() == results[False].keys()
    for name, want in results[False].items():
        assert torch.equal(results[True][name], want), name
    plain = _module().drafter.state_dict()
    moved = plain["candidate_selector.predecessor_codebook"]
    assert not torch.equal(results[True]["candidate_selector.predecessor_codebook"], moved)
