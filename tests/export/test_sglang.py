"""SGLang's rules by release and draft attention backend (issue 17 items 1, 2 and 8).

Rule sets: ``sglang==0.5.23`` (fa3/fa4/triton), ``sglang==0.5.23+flashinfer``,
``sglang==0.5.23+trtllm_mha`` and the older ``sglang#34524`` (read from the code named in
export/engines/sglang.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_lab.export.api import ExportRefused, export_drafter, inspect_dir, plan_export
from dflash_lab.export.checks import WARN, refusals
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, main
from dflash_lab.export.engines import Artifacts, select_sglang
from dflash_lab.export.engines.common import (
    END_ANCHORED,
    LEFT_ONLY,
    SYMMETRIC,
    LayerReading,
    same_attention,
)
from dflash_lab.export.formats import read_all
from dflash_lab.export.weights import Source
from tests.export_doubles import make_config, random_state, write_checkpoint

SGL, FI, TRT, OLD = ("sglang==0.5.23", "sglang==0.5.23+flashinfer", "sglang==0.5.23+trtllm_mha",
                     "sglang#34524")
GEMMA4 = "Gemma4ForConditionalGeneration"


def labels(reading):
    return None if reading.layers is None else [r.label() for r in reading.layers]


def source(layout: str, identity: dict | None = None, **kw) -> Source:
    config = make_config(layout, **kw)
    return Source(config, random_state(config), "checkpoint", f"test {layout}",
                  target_identity=identity)


def messages(findings) -> str:
    return " ".join(f.message for f in findings)


# ---------------------------------------------------------------------- item 8: 0.5.23 features
def test_0523_serves_plain_dflash_sinks_and_the_learned_mask():
    """``mimo``: all sliding bidirectional, W=8 >= B=4, learned mask and sinks (as tiny_cpu_swa)."""
    readings = read_all(make_config("mimo").to_dict(), Artifacts(True, True))
    served = readings[SGL]
    assert served.loads and served.dropped == [] and labels(served) == ["W=8 bidir"] * 3
    assert served.serves_learned_mask and served.serves_sinks
    dropped = " ".join(readings[OLD].dropped)
    assert "mask_embedding.pt" in dropped and "attention_sink_bias" in dropped


def test_flashinfer_draft_backend_cannot_take_sinks():
    reading = read_all(make_config("mimo").to_dict(), Artifacts(True, True))[FI]
    assert not reading.loads and "'sinks'" in reading.refusal and "fa3" in reading.refusal
    no_sinks = read_all(make_config("mimo", attention_sink_bias=False).to_dict(),
                        Artifacts(True, False))[FI]
    assert no_sinks.loads and no_sinks.dropped == []


def test_sink_flag_must_be_a_bool_on_0523():
    d = make_config("mimo").to_dict()
    d["dflash_config"]["attention_sink_bias"] = 1
    assert "must be a bool" in read_all(d, Artifacts(True, True))[SGL].refusal


def test_mask_and_sinks_export_for_sglang_fa3_self_checks_with_both(tmp_path):
    result = export_drafter(source("mimo"), tmp_path / "out", engine="sglang", dtype="float32",
                            sglang_backend="fa3")
    assert refusals(result.findings) == []
    check = next(c for c in result.self_check if SGL in c.rule_sets)
    assert check.ok and check.faithful  # SGLang's drafter keeps the mask row and the sinks
    report = (tmp_path / "out" / "EXPORT_REPORT.md").read_text()
    assert f"- {SGL}: yes" in report


def test_older_release_still_refuses_mask_and_sinks():
    bad = refusals(plan_export(make_config("mimo"), ("sglang",), sglang_version="#34524")[1])
    text = messages(bad)
    assert "mask_embedding.pt" in text and "attention_sink_bias" in text
    assert {f.rule_set for f in bad} == {OLD}


def test_exported_mask_file_is_the_dict_sglang_merges(tmp_path):
    """``_maybe_merge_trained_mask_embedding``: torch.load(weights_only=True), then
    ``saved["embedding"]`` copied into row ``int(saved["mask_token_id"])``; per_position refused."""
    src = source("mimo")
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    saved = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert set(saved) == {"embedding", "mask_token_id"} and not saved.get("per_position")
    table = torch.zeros(300, 32)
    table[int(saved["mask_token_id"])].copy_(saved["embedding"].to(table.dtype))
    assert int(saved["mask_token_id"]) == 7
    assert torch.equal(table[7], src.state_dict["mask_embedding"])


@pytest.mark.parametrize(("saved", "why"), [
    (lambda m: m, "bare tensor"),
    (lambda m: {"embedding": m}, "KeyError"),
    (lambda m: {"embedding": m[None], "mask_token_id": 7, "per_position": True},
     "NotImplementedError"),
])
def test_mask_files_sglang_cannot_merge_are_refused_on_inspect(tmp_path, saved, why):
    export_drafter(source("mimo"), tmp_path / "out", engine="vllm", dtype="float32")
    mask = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)["embedding"]
    torch.save(saved(mask), tmp_path / "out" / "mask_embedding.pt")
    reading = inspect_dir(tmp_path / "out", "sglang").readings[SGL]
    assert not reading.loads and why in reading.refusal


def test_cli_targets_an_sglang_release_and_backend(tmp_path, capsys):
    config = make_config("mimo")
    ckpt = write_checkpoint(tmp_path / "run.ckpt", config, random_state(config))
    common = ["--engine", "sglang", "--dtype", "float32", "--no-self_check"]
    assert main([str(ckpt), str(tmp_path / "a"), *common,
                 "--sglang_attention_backend", "triton"]) == EXIT_OK
    assert main([str(ckpt), str(tmp_path / "b"), *common, "--sglang_attention_backend", "triton",
                 "--sglang_version", "#34524"]) == EXIT_REFUSED
    assert "sglang#34524 silently drops mask_embedding.pt" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--sglang_version '0.4'"):
        select_sglang("0.4")


# ---------------------------------------------------------------------- item 2: windows by backend
def _keys(kind: str, window: int, block: int, context: int, t: int) -> set[int]:
    """Key positions query slot ``t`` sees (context 0..S-1, block S..S+B-1), from each backend's
    kernel arguments: fa3 (W-1, W-1) non-causal, flashinfer window_left only, trtllm decode rows
    of length S+B with window_left."""
    q, last = context + t, context + block - 1
    keys = range(context + block)
    if kind == SYMMETRIC:
        return {k for k in keys if abs(q - k) <= window - 1}
    if kind == LEFT_ONLY:
        return {k for k in keys if q - k <= window - 1}
    return {k for k in keys if last - k <= window - 1}


@pytest.mark.parametrize("kind", [LEFT_ONLY, END_ANCHORED])
@pytest.mark.parametrize(("window", "block"), [(3, 4), (4, 4), (8, 4), (5, 1)])
def test_same_attention_equals_brute_force_key_sets(kind, window, block):
    same = all(_keys(kind, window, block, 20, t) == _keys(SYMMETRIC, window, block, 20, t)
               for t in range(block))
    trained, engine = LayerReading(window, False, SYMMETRIC), LayerReading(window, False, kind)
    assert same_attention(trained, engine, block) is same


def test_bidirectional_window_below_block_size_by_backend():
    config = make_config("all_sliding_causal", is_causal=False, sliding_window=3)  # W=3 < B=4
    readings = read_all(config.to_dict(), Artifacts())
    assert labels(readings[SGL]) == ["W=3 bidir"] * 3  # symmetric, as trained
    assert labels(readings[FI]) == ["W=3 bidir left-only"] * 3
    assert labels(readings[TRT]) == ["W=3 bidir block-end"] * 3
    for backend in ("fa3", "fa4", "triton"):
        assert refusals(plan_export(config, ("sglang",), sglang_backend=backend)[1]) == []
    bad = refusals(plan_export(config, ("sglang",), sglang_backend="flashinfer")[1])
    assert {f.rule_set for f in bad} == {FI} and len(bad) == 3


def test_all_sliding_bidirectional_window_covering_the_block():
    """The issue's case: all sliding, bidirectional, no sinks, W >= B. fa3/fa4/triton and
    flashinfer run it as trained; trtllm_mha (which SGLang keeps for all-sliding drafters)
    anchors every query's window at the block's end, so 'any backend' refuses it."""
    config = make_config("all_sliding_causal", is_causal=False, sliding_window=4)
    for backend in ("fa3", "triton", "flashinfer"):
        assert refusals(plan_export(config, ("sglang",), sglang_backend=backend)[1]) == []
    bad = refusals(plan_export(config, ("sglang",))[1])
    assert bad and {f.rule_set for f in bad} == {TRT}
    warned = plan_export(config, ("sglang",), sglang_backend="fa3")[1]
    assert any(f.severity == WARN and f.rule_set == TRT and "--sglang_attention_backend fa3"
               in f.message for f in warned)


def test_trtllm_is_read_as_flashinfer_where_sglang_falls_back():
    readings = read_all(make_config("gemma_mixed").to_dict(), Artifacts())
    assert labels(readings[TRT]) == labels(readings[FI])
    assert any("flashinfer" in n for n in readings[TRT].notes)


# ---------------------------------------------------------------------- item 1: Gemma's scale
def test_gemma4_target_gets_sqrt_hidden_times_the_trained_input_on_sglang():
    _, findings = plan_export(make_config("mimo"), ("vllm", "sglang"),
                              target_architecture=GEMMA4, sglang_backend="fa3")
    bad = refusals(findings)
    assert bad and {f.rule_set for f in bad} == {SGL}
    assert "sqrt(hidden_size)=5.6569" in bad[0].message and "mask row" in bad[0].message
    assert refusals(plan_export(make_config("mimo"), ("vllm",), target_architecture=GEMMA4)[1]) \
        == []


def test_gemma4_drafter_trained_at_sqrt_hidden_is_what_sglang_feeds():
    config = make_config("zlab_default", input_embedding_scale=math.sqrt(32))
    readings, findings = plan_export(config, ("sglang",), target_architecture="Gemma4ForCausalLM")
    assert refusals(findings) == [] and readings[SGL].overrides == {}
    # a non-Gemma target: SGLang feeds raw rows, the trained scale is lost
    assert "input_embedding_scale" in messages(refusals(plan_export(config, ("sglang",))[1]))


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                  "Gemma3ForConditionalGeneration"])
def test_gemma_targets_without_a_dflash_hook_are_refused_by_sglang(arch):
    findings = plan_export(make_config("zlab_default"), ("sglang",), target_architecture=arch)[1]
    assert "set_dflash_layers_to_capture" in messages(refusals(findings))


def test_target_class_comes_from_the_checkpoint_or_the_target_config(tmp_path):
    gemma = {"architecture": GEMMA4}
    with pytest.raises(ExportRefused, match="sqrt"):
        export_drafter(source("zlab_default", gemma), tmp_path / "a", engine="sglang",
                       dtype="float32")
    export_drafter(source("zlab_default", gemma), tmp_path / "b", engine="vllm", dtype="float32")
    target = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 32, "vocab_size": 300}
    with pytest.raises(ExportRefused, match="set_dflash_layers_to_capture"):
        export_drafter(source("zlab_default"), tmp_path / "c", engine="sglang", dtype="float32",
                       target=target)
