"""Packed rows train the same objective as unpacked ones (issue 29 item 1).

The same documents, once as an unpacked batch (one document per row) and once packed (several
per row, ``document_ids``), with the anchors fixed to the same document positions: every
document's loss, the objective and the gradients agree to 1e-5, for DFlash 1 over every layer
layout and for DFlash 2 with a non-identity conv. Anchors drawn per document keep today's
per-sequence density.
"""

import pytest
import torch

from dflash_lab.data.module import pad_collate
from dflash_lab.data.packing import PackedRows
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import anchor_candidates, sample_anchors, step_generator
from dflash_lab.train.module import DFlashModule
from tests.doubles import LAYOUTS, tiny_drafter_config

#: Four documents; rows [[0, 1], [2, 3]] when packed (<= 24 tokens each).
LENGTHS = [9, 14, 6, 11]
ROWS = [[0, 1], [2, 3]]
V2 = {"variant": "dflash2", "conv_kernel_size": 3, "conv_group_size": 12, "selector_rank": 8,
      "selector_top_k": 5}


def _documents(cfg, seed=0):
    """Per-document tensors as a data module serves them: a 2-token prompt outside the loss."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in LENGTHS:
        mask = torch.ones(n, dtype=torch.bool)
        mask[:2] = False
        docs.append({"input_ids": torch.randint(0, cfg.vocab_size - 1, (n,), generator=g),
                     "loss_mask": mask,
                     "hidden": torch.randn(n, 3 * cfg.hidden_size, generator=g),
                     "target_argmax": torch.randint(0, cfg.vocab_size - 1, (n,), generator=g)})
    return docs


def _doc_anchors(n):
    """Fixed anchors inside a document of n tokens; the last block runs past its end (in a
    packed row, into the next document: those slots must get no loss)."""
    return [2, 4, n - 2]


def _unpacked(docs):
    batch = pad_collate(docs)
    per_doc = [_doc_anchors(len(d["input_ids"])) for d in docs]
    return batch, torch.tensor(per_doc), [(row, list(range(3))) for row in range(len(docs))]


def _packed(docs):
    rows = PackedRows(docs, ROWS, ["input_ids", "loss_mask", "hidden", "target_argmax"])
    batch = pad_collate([rows[r] for r in range(len(ROWS))])
    anchors, owners = [], []  # owners: (row, anchor columns) of each document, in doc order
    for r, row in enumerate(ROWS):
        offset, picked = 0, []
        for d in row:
            owners.append((r, list(range(len(picked), len(picked) + 3))))
            picked += [offset + a for a in _doc_anchors(LENGTHS[d])]
            offset += LENGTHS[d]
        anchors.append(picked)
    return batch, torch.tensor(anchors), owners


def _module(cfg, seed=0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    if cfg.variant == "dflash2":  # move off the identity conv and the unary-only selector
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.normal_(std=0.1)
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return DFlashModule(drafter, head, optimizer=torch.optim.SGD, gamma=4.0)


def _per_document(module, batch, anchors, owners):
    """(weighted_sum, weight_sum) of each document: its anchors alone marked valid."""
    out = []
    hidden = module.draft(batch, anchors)
    for row, cols in owners:
        valid = torch.zeros(anchors.shape, dtype=torch.bool)
        valid[row, cols] = True
        pieces = module.loss(batch, hidden, anchors, valid)
        out.append(torch.stack([pieces.weighted_sum, pieces.weight_sum]))
    return torch.stack(out)


def _objective_and_grads(module, batch, anchors):
    module.zero_grad()
    out = module.blocks_loss(batch, anchors, torch.ones(anchors.shape, dtype=torch.bool))
    loss = module.objective(out, step=10_000)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.drafter.named_parameters()
                           if p.grad is not None}


CASES = [(layout, {}) for layout in sorted(LAYOUTS)] + [
    ("full_bidirectional", V2), ("mixed_per_layer", V2)]


@pytest.mark.parametrize(("layout", "extra"), CASES,
                         ids=[f"{lay}{'-dflash2' if ex else ''}" for lay, ex in CASES])
def test_packed_and_unpacked_rows_give_the_same_per_document_loss_and_gradients(layout, extra):
    cfg = tiny_drafter_config(layout, **extra)
    module = _module(cfg)
    docs = _documents(cfg)
    plain, packed = _unpacked(docs), _packed(docs)
    assert "document_ids" in packed[0] and packed[0]["input_ids"].shape == (2, 23)
    with torch.no_grad():
        want, got = _per_document(module, *plain), _per_document(module, *packed)
    assert (want[:, 1] > 0).all()  # every document has supervised slots
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loss_u, grads_u = _objective_and_grads(module, plain[0], plain[1])
    loss_p, grads_p = _objective_and_grads(module, packed[0], packed[1])
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)
    assert grads_p.keys() == grads_u.keys() and grads_u
    for name in grads_u:
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-5, atol=1e-5,
                                   msg=name)


def test_without_document_ids_a_packed_row_would_leak_across_documents():
    """Guards the test above: the same packed row read as ONE document differs (context from
    the previous document, RoPE positions not restarted, slots supervised past a document)."""
    cfg = tiny_drafter_config("full_bidirectional")
    module = _module(cfg)
    batch, anchors, owners = _packed(_documents(cfg))
    with torch.no_grad():
        right = _per_document(module, batch, anchors, owners)
        merged = _per_document(module, {k: v for k, v in batch.items() if k != "document_ids"},
                               anchors, owners)
    assert not torch.allclose(right, merged, rtol=1e-3, atol=1e-3)
    assert torch.equal(right[0], merged[0])  # the first document sees nothing before it...
    assert (merged[:, 1] >= right[:, 1]).all()  # ...but slots past a document's end count


def test_anchors_are_drawn_per_document_with_the_unpacked_density():
    """Each document gets min(num_anchors, its candidates) anchors, all its own candidates, as
    an unpacked row of it would; a document's last position never anchors."""
    cfg = tiny_drafter_config("full_bidirectional")
    docs = _documents(cfg)
    batch = pad_collate([PackedRows(docs, ROWS, ["input_ids", "loss_mask"])[r] for r in (0, 1)])
    doc_ids, loss_mask = batch["document_ids"], batch["loss_mask"]
    cand = anchor_candidates(loss_mask, doc_ids)
    for num_anchors in (1, 4, 100):
        anchors, valid = sample_anchors(loss_mask, num_anchors, step_generator(0, 3), doc_ids)
        for row in range(2):
            picked = anchors[row][valid[row]]
            assert torch.equal(picked, picked.sort().values) and cand[row, picked].all()
            assert picked.unique().numel() == picked.numel()
            assert torch.equal(anchors[row], anchors[row].sort().values)
            for doc in doc_ids[row].unique().tolist():
                if doc < 0:
                    continue
                alone = anchor_candidates(docs[ROWS[row][doc]]["loss_mask"][None])
                mine = (doc_ids[row, picked] == doc).sum()
                assert mine == min(num_anchors, int(alone.sum()))
    again, _ = sample_anchors(loss_mask, 4, step_generator(0, 3), doc_ids)
    other, _ = sample_anchors(loss_mask, 4, step_generator(0, 4), doc_ids)
    assert torch.equal(again, sample_anchors(loss_mask, 4, step_generator(0, 3), doc_ids)[0])
    assert not torch.equal(again, other)


def test_anchor_draws_are_uniform_inside_a_document():
    """Over many steps every candidate of a document is drawn about equally often; position 5
    (document 0's last, followed by document 1's supervised first token) never is."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    docs = torch.tensor([[0] * 6 + [1] * 6])
    assert anchor_candidates(mask)[0, 5] and not anchor_candidates(mask, docs)[0, 5]
    counts = torch.zeros(12)
    for step in range(600):
        anchors, valid = sample_anchors(mask, 2, step_generator(1, step), docs)
        assert valid.sum() == 4  # 2 per document
        counts[anchors[valid]] += 1
    assert counts[[0, 5, 10, 11]].sum() == 0  # non-candidates: prompt, document ends
    share = counts[[1, 2, 3, 4, 6, 7, 8, 9]] / 600
    assert (share - 0.5).abs().max() < 0.1  # 2 of 4 candidates per document


def test_rope_positions_restart_at_every_document():
    """Context and block RoPE positions of a packed row are positions inside each document
    (RoPE scores depend on position differences, so the loss alone would not show this)."""
    cfg = tiny_drafter_config("full_bidirectional")
    module = _module(cfg)
    batch, anchors, _ = _packed(_documents(cfg))
    seen = []
    rotary = module.drafter.rotary
    real = rotary.forward
    rotary.forward = lambda positions, dtype: seen.append(positions) or real(positions, dtype)
    with torch.no_grad():
        module.draft(batch, anchors)
    ctx, blk = seen
    assert ctx[0].tolist() == list(range(9)) + list(range(14))
    assert ctx[1].tolist() == list(range(6)) + list(range(11)) + list(range(6))  # pads: a run
    assert blk.view(2, -1, cfg.block_size)[0, :, 0].tolist() == [2, 4, 7, 2, 4, 12]


# ----------------------------------------------------------------------------- dflash-train
def test_dflash_train_with_data_pack_trains_packed_rows(tiny_target_dir, tmp_path, monkeypatch):
    """``dflash-train recipe=tiny_cpu data.pack=true data.max_tokens_per_row=384``: the steps
    see packed rows (several documents, document_ids) and the run trains and validates."""
    from dflash_lab.train.run import train
    from tests.train.test_train import _compose, _tiny_overrides

    seen = []
    real = DFlashModule.step
    monkeypatch.setattr(DFlashModule, "step", lambda self, batch, g: seen.append(
        batch["document_ids"].max(dim=1).values.tolist()) or real(self, batch, g))
    cfg = _compose(_tiny_overrides(tmp_path, tiny_target_dir, rows=48, **{
        "data.pack": True, "data.max_tokens_per_row": 384, "data.batch_size": 2,
        "trainer.max_steps": 3, "validate_before_fit": False}))
    result = train(cfg)
    assert len(seen) >= 3 and max(max(s) for s in seen) >= 1  # rows of >= 2 documents
    assert result["val_tau_after"] >= 1.0


def test_data_pack_without_a_row_length_is_refused_at_start_up(tiny_target_dir, tmp_path):
    from dflash_lab.train.checks import check_train_config
    from tests.train.test_train import _compose, _tiny_overrides

    cfg = _compose(_tiny_overrides(tmp_path, tiny_target_dir, **{"data.pack": True}))
    with pytest.raises(ValueError, match="data.pack=true needs data.max_tokens_per_row"):
        check_train_config(cfg)
