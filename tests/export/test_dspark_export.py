"""The DSpark export in vLLM 0.32's speculators layout (export/formats/dspark.py), its import back
(--inspect, the loaders dflash-eval and drafter.init_from use), the refusals, and vLLM's own
config converter, loader and heads on it (scripts/vllm_dspark_pieces.py, with .venv-vllm)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from dflash_lab.export import ExportRefused, export_drafter, inspect_dir, load_source
from dflash_lab.export.formats.dspark import reading_lines, update_dspark
from dflash_lab.export.weights import Source, expected_shapes
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from tests.doubles import tiny_drafter_config

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def _source(seed: int = 0, **overrides) -> Source:
    fields = dict(variant="dspark", markov_rank=6, sample_from_anchor=True) | overrides
    config = tiny_drafter_config(**fields)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.3
             for k, shape in expected_shapes(config).items()}
    return Source(config, state, "checkpoint", "test_dspark_export")


@pytest.mark.parametrize("anchor", [True, False])
def test_the_config_is_what_update_dspark_reads_every_key_explicit(tmp_path, anchor):
    src = _source(sample_from_anchor=anchor)
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["speculators_model_type"] == "dspark" and d["architectures"] == ["Qwen3DSparkModel"]
    for key in ("sample_from_anchor", "markov_rank", "markov_head_type", "mask_token_id",
                "enable_confidence_head", "confidence_head_with_markov", "block_size"):
        assert key in d, key  # explicit: vLLM's default for sample_from_anchor is false
    assert d["transformer_layer_config"]["is_causal"] is False
    view = update_dspark(d)
    assert view["target_layer_ids"] == list(src.config.target_layer_ids)
    assert d["aux_hidden_state_layer_ids"] == [i + 1 for i in src.config.target_layer_ids]
    assert view["dspark_bonus_anchor"] is (not anchor)
    tokens = d["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert tokens == src.config.num_draft_tokens == (4 if anchor else 3)


@pytest.mark.parametrize("kind", ["vanilla", "no_confidence_markov"])
def test_export_import_round_trip_drafts_the_same(tmp_path, kind):
    """export -> load_source (what dflash-eval drafter.path= and drafter.init_from read) gives
    the same config, every tensor, and the same greedy drafts through the Markov walk."""
    extra = {} if kind == "vanilla" else {"confidence_head_with_markov": False}
    src = _source(seed=3, **extra)
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    back = load_source(tmp_path / "out")
    assert back.config.to_dict() == src.config.to_dict()
    assert back.state_dict.keys() == src.state_dict.keys()
    assert all(torch.equal(back.state_dict[k], src.state_dict[k]) for k in src.state_dict)
    assert back.description.startswith("DSpark directory") and back.depth_recorded
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, src.config.block_size, src.config.hidden_size, generator=gen)
    anchors = torch.randint(0, src.config.vocab_size, (3,), generator=gen)
    head = torch.nn.Linear(src.config.hidden_size, src.config.vocab_size, bias=False)
    drafts = []
    for s in (src, back):
        drafter = DFlashDrafter(s.config).eval()
        drafter.load_state_dict(s.state_dict, strict=True)
        drafts.append(drafter.propose(hidden, anchors, head))
    assert torch.equal(drafts[0], drafts[1])
    # the Markov head is live: without it the drafts differ (the test can fail)
    plain = DFlashDrafter(src.config).eval()
    plain.load_state_dict({k: (torch.zeros_like(v) if k.endswith("markov_w2.weight") else v)
                           for k, v in src.state_dict.items()})
    assert not torch.equal(plain.propose(hidden, anchors, head), drafts[0])


def test_inspect_shows_update_dspark_and_the_engines(tmp_path):
    export_drafter(_source(), tmp_path / "out", engine="vllm", dtype="float32")
    result = inspect_dir(tmp_path / "out")
    assert result.ok, result.text
    assert "vLLM 0.32 update_dspark" in result.text
    assert "aux_hidden_state_layer_ids [2, 4, 5] -> target_layer_ids [1, 3, 4]" in result.text
    assert "variant: dspark" in result.text and "markov_rank=6" in result.text
    assert result.readings["vllm-main-v2"].loads
    assert not result.readings["vllm-main-v1"].loads  # DSpark: the V2 GPU runner only
    assert all(not r.loads for n, r in result.readings.items() if n.startswith("sglang"))
    # an edited top-level key is caught: vLLM would read another drafter
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    d["markov_rank"] = 7
    (tmp_path / "out" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="markov_rank=7.*re-export"):
        load_source(tmp_path / "out", verify=False)


def test_sglang_and_what_vllm_cannot_serve_are_refused_by_name(tmp_path):
    with pytest.raises(ExportRefused, match="SGLang 0.5.23.*speculators"):
        export_drafter(_source(), tmp_path / "a", engine="sglang", dtype="float32")
    with pytest.raises(ValueError, match="markov_head_type='gated'.*vanilla only"):
        export_drafter(_source(markov_head_type="gated"), tmp_path / "b", engine="vllm")
    with pytest.raises(ValueError, match="markov_rank=0"):
        export_drafter(_source(markov_rank=0, enable_confidence_head=True,
                               confidence_head_with_markov=False), tmp_path / "c",
                       engine="vllm")
    with pytest.raises(ValueError, match="only in vLLM's speculators DSpark layout"):
        export_drafter(_source(), tmp_path / "d", engine="vllm", format="laguna")
    assert not any((tmp_path / n).exists() for n in "abcd")


def _pieces_module():
    from scripts import vllm_dspark_pieces

    return vllm_dspark_pieces


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make vllm-venv)")
def test_vllm_qwen3_dspark_reads_loads_and_computes_our_heads(tmp_path):
    """vLLM's SpeculatorsConfig + update_dspark read our config as trained, its
    Qwen3DSparkForCausalLM loader writes every parameter from our tensors, and its Markov
    embedding, bias and confidence equal ours (float32)."""
    pieces = _pieces_module()
    case = pieces.prepare_case(tmp_path / "case")
    done = subprocess.run([str(VLLM_PYTHON), "-m", "scripts.vllm_dspark_pieces", str(case)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = pieces.compare_case(case)
    assert result["passed"], result
    assert set(result["diffs"]) == {"markov_embed", "markov_bias", "confidence"}


# ---------------------------------------------------------------------------- eval, warm start
def _tiny_export(tiny_target, path):
    """A DSpark export for the built-in tiny target (hidden 64, vocab 768, 8 layers), trained
    Markov head stand-in (random w2), sliding + full layers."""
    from tests.train.test_warm_start import tiny_source_config

    config = tiny_source_config(tiny_target, variant="dspark", markov_rank=8,
                                markov_head_type="vanilla", enable_confidence_head=True,
                                confidence_head_with_markov=True, sample_from_anchor=True)
    gen = torch.Generator().manual_seed(5)
    state = {k: torch.randn(shape, generator=gen) * 0.2
             for k, shape in expected_shapes(config).items()}
    export_drafter(Source(config, state, "checkpoint", "tiny dspark"), path, engine="vllm",
                   dtype="float32")
    return config, state


def test_cli_eval_of_a_dspark_export_is_lossless(tiny_target, tiny_target_dir, tmp_path,
                                                 monkeypatch):
    from tests.eval_doubles import cli_eval_report, demo_prompts

    _tiny_export(tiny_target, tmp_path / "export")
    prompts = demo_prompts(tmp_path / "prompts.jsonl")
    report = cli_eval_report(monkeypatch, tiny_target_dir, tmp_path / "export", prompts,
                             tmp_path / "out")
    assert report["lossless"] is True and report["tau_mean"] >= 1.0
    assert report["settings"]["drafter_source"].startswith("DSpark directory")


def test_warm_start_from_a_dspark_export_holds_its_drafter(tiny_target, tmp_path):
    from tests.train.test_warm_start import assert_same_weights, warm

    config, state = _tiny_export(tiny_target, tmp_path / "export")
    drafter = warm(tiny_target, tmp_path / "export", variant="dspark")
    assert drafter.config.to_dict() == config.to_dict()
    assert_same_weights(drafter, state)


def test_a_speculators_dspark_directory_is_read_and_re_exported_explicitly(tiny_target, tmp_path):
    """speculators 0.9.0's DSparkSpeculatorConfig layout (architectures DSparkSpeculator, the
    DFlash keys plus the DSpark ones): absent keys take its defaults (sample_from_anchor true),
    where vLLM's update_dspark defaults sample_from_anchor to false; re-export writes it."""
    from tests.train.test_warm_start import (
        speculators_dict,
        tiny_source_config,
        write_speculators_dir,
    )

    config = tiny_source_config(tiny_target, variant="dspark", markov_rank=8,
                                markov_head_type="vanilla", enable_confidence_head=True,
                                confidence_head_with_markov=False, sample_from_anchor=True)
    d = speculators_dict(config)
    d.update(architectures=["DSparkSpeculator"], speculators_model_type="dspark",
             markov_rank=8, confidence_head_with_markov=False)
    d.pop("sample_from_anchor")  # speculators' default: true
    gen = torch.Generator().manual_seed(2)
    state = {k: torch.randn(s, generator=gen) for k, s in expected_shapes(config).items()}
    sdir = write_speculators_dir(tmp_path / "spec", d, state)
    src = load_source(sdir)
    assert src.config.variant == "dspark" and src.config.sample_from_anchor is True
    assert (src.config.markov_rank, src.config.confidence_head_with_markov) == (8, False)
    assert src.config.target_layer_ids == [1, 3, 5]
    assert all(torch.equal(src.state_dict[k], state[k]) for k in state)
    assert "(vLLM's default; speculators' is true)" in "\n".join(reading_lines(d))
    problems = inspect_dir(sdir).problems  # vLLM would run it as false: one position off
    assert any("vllm-main-v2 silently drops sample_from_anchor (absent" in p for p in problems)
    export_drafter(sdir, tmp_path / "out", engine="vllm", dtype="float32")
    assert inspect_dir(tmp_path / "out").ok
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["sample_from_anchor"] is True and update_dspark(out)["dspark_bonus_anchor"] is False
