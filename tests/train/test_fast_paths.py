"""The training fast paths (issue 8), each as a behaviour: one mask per distinct layer spec per
forward, context K/V once per layer per step, the vectorised dense mask, labels and vocab
projection only at valid anchored slots, and a compiled layer stack that neither changes
results nor recompiles every step. (Sorted anchors and chunked CE: tests/train/test_loss.py.)"""

import pytest
import torch

from dflash_lab.attention.base import get_backend
from dflash_lab.attention.mask import BlockLayout, dense_mask, visible
from dflash_lab.model.config import FULL, SLIDING, LayerSpec
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import sample_anchors, step_generator
from dflash_lab.train.loss import block_targets, token_targets
from dflash_lab.train.objective import dflash_loss
from tests.doubles import tiny_drafter_config

SPECS = [LayerSpec(None, False), LayerSpec(None, True), LayerSpec(3, True), LayerSpec(5, False),
         LayerSpec(2, False)]


def _batch(cfg, bt=2, s=24, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bt, s, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (bt, s), generator=g)
    anchors, valid = sample_anchors(torch.ones(bt, s, dtype=torch.long), n, step_generator(0, 0))
    return hidden, ids, anchors, valid


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_vectorised_dense_mask_equals_the_predicate_row_by_row(spec):
    anchors, _ = sample_anchors(torch.ones(3, 30, dtype=torch.long), 6, step_generator(1, 2))
    layout = BlockLayout(anchors, 30, 4)
    q_idx = torch.arange(layout.num_queries)[:, None]
    kv_idx = torch.arange(layout.num_keys)[None, :]
    per_row = torch.stack([visible(q_idx, kv_idx, a, 30, 4, spec) for a in anchors])
    assert torch.equal(dense_mask(layout, spec)[:, 0], per_row)


@pytest.mark.parametrize("layout", ["mixed_swa", "mixed_per_layer", "full_bidirectional"])
def test_key_tiled_sdpa_drafter_equals_one_dense_call_outputs_and_gradients(layout):
    """A training call big enough for key tiles (Q*K >= MIN_TILED_PAIRS) against the same
    drafter making one dense SDPA call per layer (static_shapes), with sinks and a learned mask."""
    from dflash_lab.attention.sdpa import MIN_TILED_PAIRS, KeyTile

    cfg = tiny_drafter_config(layout, attention_sink_bias=True, learned_mask_embedding=True)
    torch.manual_seed(0)
    tiled, dense = DFlashDrafter(cfg), DFlashDrafter(cfg)
    dense.load_state_dict(tiled.state_dict())
    dense.static_shapes = True
    with torch.no_grad():
        for d in (tiled, dense):
            d.layers[0].self_attn.attention_sink_bias.fill_(0.5)
    hidden, ids, anchors, _ = _batch(cfg, s=192, n=48)
    layout_ = BlockLayout(anchors, 192, cfg.block_size)
    assert layout_.num_queries * layout_.num_keys >= MIN_TILED_PAIRS
    spec = cfg.layer_specs()[0]
    assert isinstance(tiled.backend(hidden.device, packed=True).prepare(layout_, spec)[0], KeyTile)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).double()
    tiled, dense, hidden = tiled.double(), dense.double(), hidden.double()  # exact comparison
    a = tiled(hidden, ids, anchors, embed)
    b = dense(hidden, ids, anchors, embed)
    torch.testing.assert_close(a, b)
    probe = torch.randn_like(a)
    ga = torch.autograd.grad((a * probe).sum(), list(tiled.parameters()))
    gb = torch.autograd.grad((b * probe).sum(), list(dense.parameters()))
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y)


class CountingBackend:
    """Wraps a backend and counts prepare() calls per layer spec."""

    def __init__(self, inner):
        self.inner, self.name, self.prepared = inner, inner.name, []

    def prepare(self, layout, spec):
        self.prepared.append(spec)
        return self.inner.prepare(layout, spec)

    def attend(self, *args, **kwargs):
        return self.inner.attend(*args, **kwargs)


def test_one_mask_per_distinct_layer_spec_per_forward(monkeypatch):
    cfg = tiny_drafter_config("mixed_swa", num_hidden_layers=4,
                              layer_types=[SLIDING, FULL, SLIDING, FULL])
    drafter = DFlashDrafter(cfg)
    counting = CountingBackend(get_backend("sdpa"))
    monkeypatch.setattr(drafter, "backend", lambda device, packed: counting)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    hidden, ids, anchors, _ = _batch(cfg)
    drafter(hidden, ids, anchors, embed)
    assert set(counting.prepared) == set(cfg.layer_specs())
    assert len(counting.prepared) == 2  # four layers, two distinct specs


def test_context_kv_is_computed_once_per_layer_per_step_not_per_block():
    cfg = tiny_drafter_config("full_bidirectional")
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    hidden, ids, anchors, _ = _batch(cfg, bt=2, s=24, n=5)
    seen = {i: [] for i in range(cfg.num_hidden_layers)}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out, i=i: seen[i].append(inp[0].shape[1]))
        for i, layer in enumerate(drafter.layers)]
    drafter(hidden, ids, anchors, embed).sum().backward()
    for h in hooks:
        h.remove()
    n_queries = anchors.shape[1] * cfg.block_size
    for rows in seen.values():  # one call over the S context rows, one over all block slots
        assert sorted(rows) == sorted([24, n_queries])


def test_vocab_projection_sees_only_valid_anchored_slots():
    cfg = tiny_drafter_config("full_bidirectional")
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).requires_grad_(False)
    hidden, ids, _, _ = _batch(cfg, bt=2, s=24)
    loss_mask = torch.zeros(2, 24, dtype=torch.long)
    loss_mask[:, 10:20] = 1  # a short assistant span; padded anchors in the shorter row
    loss_mask[1, 15:] = 0
    anchors, valid = sample_anchors(loss_mask, 8, step_generator(0, 3))
    out = drafter(hidden, ids, anchors, embed)
    tgt = block_targets(token_targets(ids, ids, "target_argmax"), loss_mask, anchors, valid,
                        cfg.block_size)
    rows = []
    hook = lm_head.register_forward_hook(lambda mod, inp, o: rows.append(inp[0].shape[0]))
    with torch.no_grad():  # the module path (validation)
        dflash_loss(out, tgt, lm_head, gamma=4.0, chunk_size=7, block_valid_bn=valid)
    hook.remove()
    m = int(tgt.valid.sum())
    assert 0 < m < anchors.numel() * cfg.block_size
    assert sum(rows) == m and max(rows) <= 7  # only valid slots, in chunks
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as flops:  # the training path (fused, frozen head)
        dflash_loss(out, tgt, lm_head, gamma=4.0, chunk_size=7, block_valid_bn=valid)
    assert flops.get_total_flops() == 2 * (2 * m * cfg.hidden_size * cfg.vocab_size)


def test_compiled_layer_stack_matches_eager_and_does_not_recompile_per_step():
    torch._dynamo.reset()
    cfg = tiny_drafter_config("mixed_swa")
    torch.manual_seed(0)
    eager = DFlashDrafter(cfg)
    compiled = DFlashDrafter(cfg)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_layers(backend="eager", dynamic=False)  # dynamo tracing only: no C++
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    torch._dynamo.utils.counters.clear()
    for step in range(3):  # fresh anchors every step, same shapes
        hidden, ids, anchors, _ = _batch(cfg, seed=step)
        anchors, _ = sample_anchors(torch.ones(2, 24, dtype=torch.long), 5,
                                    step_generator(0, step))
        a = eager(hidden, ids, anchors, embed)
        b = compiled(hidden, ids, anchors, embed)
        torch.testing.assert_close(b, a)
        ga = torch.autograd.grad(a.square().sum(), list(eager.parameters()))
        gb = torch.autograd.grad(b.square().sum(), list(compiled.parameters()))
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x)
        if step == 0:
            frames_after_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames_after_first > 0  # the layers really were traced
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_after_first
    torch._dynamo.reset()


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


@pytest.mark.gpu
@requires_cuda
def test_compiled_blockmask_builder_is_reused_across_steps_on_gpu():
    """H=None BlockMask from the compiled builder: fresh anchors each step, no recompilation."""
    torch._dynamo.reset()
    backend = get_backend("flex", "cuda")
    spec = LayerSpec(None, False)
    torch._dynamo.utils.counters.clear()
    for step in range(4):
        anchors, _ = sample_anchors(torch.ones(2, 256, dtype=torch.long), 32,
                                    step_generator(0, step))
        layout = BlockLayout(anchors.cuda(), 256, 8)
        bm = backend.prepare(layout, spec)
        assert bm.kv_num_blocks.shape[1] == 1  # H=None: one head slot shared by all heads
        if step == 0:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # the visited tiles are exactly the 128x128 tiles with a visible entry
        want = dense_mask(layout, spec)[:, 0]
        tiles = want.unflatten(1, (-1, 128)).unflatten(3, (-1, 128)).any(dim=4).any(dim=2)
        assert torch.equal(bm.to_dense()[:, 0].bool(), tiles)
    assert graphs > 0  # the builder really is compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout_name", ["full_bidirectional", "mixed_swa"])
def test_bf16_training_steps_on_gpu_flex_match_sdpa_and_learn(layout_name):
    """The GPU training path (flex, compiled mask and kernel) against sdpa on the same
    weights in fp32, then bf16 optimizer steps that stay finite and lower the loss."""
    from functools import partial

    from dflash_lab.targets.target import TargetPieces
    from dflash_lab.train.loss import global_weighted_loss
    from dflash_lab.train.module import DFlashModule

    cfg = tiny_drafter_config(layout_name, block_size=8)
    torch.manual_seed(0)
    hidden, ids, _, _ = _batch(cfg, bt=2, s=64)
    batch = {"hidden": hidden.cuda(), "input_ids": ids.cuda(), "target_argmax": ids.cuda(),
             "loss_mask": torch.ones(2, 64, dtype=torch.long, device="cuda")}
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    losses, grads = {}, {}
    for backend in ("sdpa", "flex"):
        torch.manual_seed(1)
        drafter = DFlashDrafter(cfg, backend=backend).cuda()
        module = DFlashModule(drafter, TargetPieces(embed, torch.nn.Identity(), head),
                              partial(torch.optim.AdamW, lr=1e-2), num_anchors=6).cuda()
        out = module.blocks_loss(batch, *module.sample_anchors(batch, step_generator(0, 0)))
        loss = global_weighted_loss(out.weighted_sum, out.weight_sum)
        losses[backend] = loss
        grads[backend] = torch.autograd.grad(loss, list(drafter.parameters()))
    torch.testing.assert_close(losses["flex"], losses["sdpa"], atol=2e-4, rtol=2e-4)
    for a, b in zip(grads["flex"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-3)

    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, backend="flex").cuda().to(torch.bfloat16)
    pieces = TargetPieces(embed, torch.nn.Identity(), head).cuda().to(torch.bfloat16)
    module = DFlashModule(drafter, pieces, partial(torch.optim.AdamW, lr=1e-2), num_anchors=6)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    bf16_batch = {**batch, "hidden": batch["hidden"].to(torch.bfloat16)}
    history = []
    for _ in range(30):
        anchors = module.sample_anchors(bf16_batch, step_generator(0, 0))  # fixed: memorise
        out = module.blocks_loss(bf16_batch, *anchors)
        loss = global_weighted_loss(out.weighted_sum, out.weight_sum)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(float(loss))
    assert all(torch.isfinite(torch.tensor(history)))
    assert history[-1] < 0.7 * history[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_head_ce_matches_full_logits_and_projects_twice_not_three_times(dtype):
    """Frozen LM head: the chunked CE computes the input gradient in forward (no recompute)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_lab.train.loss import chunked_head_pass

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False).to(dtype).requires_grad_(False)
    base = torch.randn(37, 16, dtype=dtype)
    y = torch.randint(0, 300, (37,))
    w = torch.rand(37, dtype=torch.float32)
    h1, h2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    with FlopCounterMode(display=False) as fused_flops:
        out = chunked_head_pass(h1, y, head, chunk_size=8)
        ce, ok = out.ce, out.correct
        (w * ce).sum().backward()
    logits = head(h2).float()
    ref = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    (w * ref).sum().backward()
    tol = {} if dtype == torch.float64 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ce, ref, **tol)
    assert torch.equal(ok, logits.argmax(-1) == y)
    torch.testing.assert_close(h1.grad, h2.grad, **tol)
    one_projection = 2 * 37 * 16 * 300
    assert fused_flops.get_total_flops() == 2 * one_projection
