"""DFlash 2 drafters through the exporter: serving names, engine rules with reasons, inspect,
import of z-lab directories (hand-written and written by z-lab's own code), the three scales, a
golden config.json, and vLLM's own qwen3_dflash2 pieces on our export."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.export import (
    ExportRefused,
    export_drafter,
    import_drafter,
    inspect_dir,
    plan_export,
)
from dflash_lab.export.api import serving_config
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, main
from dflash_lab.export.engines import get_rule_set
from dflash_lab.export.engines.common import Artifacts
from dflash_lab.export.engines.zlab import base_config
from dflash_lab.export.formats import read_all
from dflash_lab.export.selfcheck import run_self_check
from dflash_lab.export.weights import WEIGHTS_FILE, Source, expected_shapes
from dflash_lab.model.config import TRAINING_SPEC_KEY, DrafterConfig
from dflash_lab.paths import REPO_ROOT
from tests.export_doubles import make_config, random_state, write_checkpoint, write_zlab_dir

ZLAB_PYTHON = REPO_ROOT / ".venv-dflash" / "bin" / "python"
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
GOLDEN = Path(__file__).parent / "golden" / "export_config"
#: H=32 -> 4 conv groups of 8; K=3 taps inside blocks of 4; rank 8 codebooks, top 5 candidates
V2 = dict(variant="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=8,
          selector_top_k=5)
SCALES = dict(input_embedding_scale=1.5, output_multiplier=0.7, final_logit_softcapping=6.0)
NOT_WRITTEN = {"transformers_version", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
               "initializer_range", "use_cache", "max_window_layers", "rope_parameters"}


def v2_source(layout: str = "zlab_default", seed: int = 0, **kw) -> Source:
    config = make_config(layout, **{**V2, **kw})
    return Source(config, random_state(config, seed), "checkpoint", f"test dflash2 {layout}")


def refusal_text(err: pytest.ExceptionInfo) -> str:
    return "\n".join(f.message for f in err.value.findings)


# ---------------------------------------------------------------------------- export format
def test_expected_shapes_are_the_dflash2_drafters_state_dict():
    from dflash_lab.model.drafter import DFlashDrafter

    config = make_config("all_sliding_causal", **V2)
    real = {k: tuple(v.shape) for k, v in DFlashDrafter(config).state_dict().items()}
    assert expected_shapes(config) == real
    assert real["candidate_selector.predecessor_codebook"] == (300, 8)  # bare, no ".weight"
    assert real["layers.2.mlp_conv.kernel_projection.weight"] == (2 * 3 * 4, 32)


def test_export_writes_the_serving_names_and_flat_keys(tmp_path):
    export_drafter(v2_source(**SCALES), tmp_path / "out", engine="vllm", dtype="float32")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in (*V2, *SCALES) if k != "variant"} == \
        {**{k: v for k, v in V2.items() if k != "variant"}, **SCALES}
    names = set(load_file(str(tmp_path / "out" / WEIGHTS_FILE)))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.2.mlp_conv.kernel_projection.weight"} <= names
    assert not any(n.endswith("codebook.weight") for n in names)
    report = (tmp_path / "out" / "EXPORT_REPORT.md").read_text()
    assert "- variant: dflash2 (DFlash2DraftModel)" in report
    assert "- vllm-main-v2: yes" in report
    assert "num_speculative_tokens = block_size - 1 = 3" in report


def test_export_from_a_checkpoint_of_the_drafter_module(tmp_path):
    from dflash_lab.model.drafter import DFlashDrafter

    config = make_config("zlab_default", **V2)
    drafter = DFlashDrafter(config)
    ckpt = write_checkpoint(tmp_path / "run" / "last.ckpt", config, drafter.state_dict())
    export_drafter(ckpt, tmp_path / "out", engine="vllm", dtype="float32")
    assert import_drafter(tmp_path / "out").state_dict.keys() == drafter.state_dict().keys()


def test_export_inspect_import_round_trip_is_lossless(tmp_path):
    src = v2_source("all_sliding_causal", output_multiplier=0.7, final_logit_softcapping=6.0)
    export_drafter(src, tmp_path / "out", dtype="float32")  # both engines: no scale SGLang drops
    result = inspect_dir(tmp_path / "out")
    assert result.ok, result.problems
    assert "conv_kernel_size=3, conv_group_size=8 (4 groups)" in result.text
    assert "selector_rank=8, selector_top_k=5" in result.text
    assert "output_multiplier=0.7, final_logit_softcapping=6.0" in result.text
    assert "- sglang==0.5.23: yes" in result.text
    imported = import_drafter(tmp_path / "out")
    assert imported.config == src.config
    assert imported.state_dict.keys() == src.state_dict.keys()
    assert all(torch.equal(imported.state_dict[k], v) for k, v in src.state_dict.items())


def test_golden_config_json_for_a_dflash2_layout():
    """The released layout (all sliding bidirectional) with every scale on, at toy size."""
    config = make_config("mimo", learned_mask_embedding=False, attention_sink_bias=False,
                         **V2, **SCALES)
    got = serving_config(config, "bfloat16")
    path = GOLDEN / "zlab_layout_dflash2_scales.json"
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert path.is_file(), f"no golden file {path}; run with DFLASH_UPDATE_GOLDEN=1"
    assert got == json.loads(path.read_text())


# ---------------------------------------------------------------------------- engine rules
@pytest.mark.parametrize(("rule_set", "why"), [
    ("vllm-main-v1", "Model Runner V1 does not support: DFlash candidate-head drafts"),
    ("vllm<=0.26-v2", "vllm-project/vllm#52816"),
    ("sglang#34262..#34524", "sgl-project/sglang#35371"),
    ("sglang<#34262", "sgl-project/sglang#35371"),
])
def test_engines_that_cannot_run_dflash2_refuse_with_the_reason(rule_set, why):
    raw = make_config("zlab_default", **V2).to_dict()
    reading = get_rule_set(rule_set).read(raw, Artifacts())
    assert not reading.loads and why in reading.refusal


@pytest.mark.parametrize("rule_set", ["vllm-main-v2", "sglang==0.5.23"])
def test_current_engines_load_dflash2_with_every_layer_as_trained(rule_set):
    config = make_config("all_sliding_causal", **V2, output_multiplier=0.7)
    reading = get_rule_set(rule_set).read(config.to_dict(), Artifacts())
    assert reading.loads and not reading.dropped and not reading.overrides
    assert [(r.window, r.causal) for r in reading.layers] == [(8, True)] * 3


@pytest.mark.parametrize(("removed", "vllm_refusal", "sglang"), [
    (["selector_rank"], "KeyError", "refuses: DFlash selector draft requires"),
    (["conv_kernel_size", "conv_group_size"], "KeyError", "drops: SGLang builds no conv"),
    (["conv_group_size"], "KeyError", "refuses: conv_kernel_size and conv_group_size together"),
])
def test_dflash2_keys_missing_from_dflash_config(removed, vllm_refusal, sglang):
    """Both engines read the DFlash 2 keys from dflash_config only (a top-level copy is unread)."""
    raw = make_config("zlab_default", **V2).to_dict()
    for key in removed:
        raw[key] = raw["dflash_config"].pop(key)
    v2 = get_rule_set("vllm-main-v2").read(raw, Artifacts())
    assert not v2.loads and vllm_refusal in v2.refusal and removed[0] in v2.refusal
    sgl = get_rule_set("sglang==0.5.23").read(raw, Artifacts())
    kind, text = sglang.split(": ", 1)
    assert text in (sgl.refusal if kind == "refuses" else " ".join(sgl.dropped))


def test_vllm_only_export_warns_about_the_v1_runner(tmp_path):
    result = export_drafter(v2_source(), tmp_path / "out", engine="vllm", dtype="float32")
    warnings = [f.message for f in result.findings]
    assert any("vllm-main-v1 refuses to load it" in w and "VLLM_USE_V2_MODEL_RUNNER=1" in w
               for w in warnings)


@pytest.mark.parametrize("engine", ["sglang", "both"])
def test_input_embedding_scale_is_refused_where_sglang_is_targeted(tmp_path, engine):
    with pytest.raises(ExportRefused) as err:
        export_drafter(v2_source(input_embedding_scale=1.5), tmp_path / "out", engine=engine)
    assert "sglang==0.5.23 silently drops input_embedding_scale" in refusal_text(err)
    assert "SGLang never reads it" in refusal_text(err) and not (tmp_path / "out").exists()
    export_drafter(v2_source(input_embedding_scale=1.5), tmp_path / "v", engine="vllm",
                   dtype="float32")  # vLLM's qwen3_dflash2 multiplies the block inputs


def test_dflash1_scales_are_refused_for_vllm_only(tmp_path):
    config = make_config("zlab_default", output_multiplier=0.7)
    src = Source(config, random_state(config), "checkpoint", "dflash1 with a scale")
    with pytest.raises(ExportRefused) as err:
        export_drafter(src, tmp_path / "out", engine="vllm")
    assert "qwen3_dflash.py) never reads it" in refusal_text(err)
    assert "T > 0 proposals differ" in refusal_text(err)
    export_drafter(src, tmp_path / "sgl", engine="sglang", dtype="float32")  # greedy drafts


def test_allowed_lossy_self_check_builds_the_engines_drafter_without_the_scale(tmp_path):
    result = export_drafter(v2_source(input_embedding_scale=1.5), tmp_path / "out",
                            engine="sglang", dtype="float32", allow_lossy=True)
    [check] = result.self_check
    # every 0.5.23 draft backend builds the same drafter (the layers are causal)
    assert check.rule_sets == ["sglang==0.5.23", "sglang==0.5.23+flashinfer",
                               "sglang==0.5.23+trtllm_mha"] and not check.faithful
    assert check.config_diff > 1e-3  # the unscaled block inputs give other drafts


def test_self_check_compares_the_selector_scores(tmp_path):
    """The codebooks do not touch the hidden states: only the selector comparison sees them."""
    src = v2_source()
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    other = dict(src.state_dict)
    other["candidate_selector.successor_codebook"] = torch.randn(300, 8)
    results, _ = run_self_check(tmp_path / "out", raw, src.config, other,
                                [get_rule_set("vllm-main-v2")], Artifacts(), torch.float32)
    assert results[0].total_diff > 1e-2 and not results[0].ok


def test_target_with_another_vocab_is_refused_with_the_full_vocabulary_reason():
    config = make_config("zlab_default", **V2)
    target = {"hidden_size": 32, "vocab_size": 280, "num_hidden_layers": 6}
    _, findings = plan_export(config, ("vllm",), target=target)
    assert any("FULL target vocabulary" in f.message and f.severity == "refuse"
               for f in findings)


def test_cli_exports_inspects_and_refuses_with_exit_codes(tmp_path, capsys):
    config = make_config("zlab_default", **V2, input_embedding_scale=1.5)
    d = write_zlab_dir(tmp_path / "zlab", zlab_v2_config(), random_state(config))
    assert main([str(d), str(tmp_path / "sgl"), "--engine", "sglang"]) == EXIT_REFUSED
    assert "input_embedding_scale" in capsys.readouterr().err
    argv = [str(d), str(tmp_path / "v"), "--engine", "vllm", "--dtype", "float32"]
    assert main(argv) == EXIT_OK
    assert main(["--inspect", str(tmp_path / "v"), "--engine", "vllm"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "- variant: dflash2 (DFlash2DraftModel)" in out and "- vllm-main-v2: yes" in out


# ---------------------------------------------------------------------------- inspect problems
def test_inspect_flags_missing_conv_and_selector_tensors(tmp_path, capsys):
    export_drafter(v2_source(), tmp_path / "out", engine="vllm", dtype="float32")
    file = tmp_path / "out" / WEIGHTS_FILE
    weights = load_file(str(file))
    del weights["layers.1.attention_conv.base_kernel"]
    del weights["candidate_selector.successor_codebook"]
    save_file(weights, str(file))
    result = inspect_dir(tmp_path / "out", "vllm")
    assert not result.ok
    assert any("needs its conv and selector tensors" in p and "layers.1.attention_conv.base_kernel"
               in p for p in result.problems)
    assert main(["--inspect", str(tmp_path / "out"), "--engine", "vllm"]) == EXIT_REFUSED
    assert "NOT OK" in capsys.readouterr().out
    with pytest.raises(ValueError, match="missing"):
        import_drafter(tmp_path / "out")


def test_inspect_of_a_dflash1_dir_declaring_dflash2_keys_is_not_ok(tmp_path):
    """A DFlash2DraftModel architecture over DFlash 1 weights: no conv, no selector."""
    config = make_config("zlab_default")
    raw = make_config("zlab_default", **V2).to_dict()
    raw.pop(TRAINING_SPEC_KEY)
    write_zlab_dir(tmp_path / "d", raw, random_state(config))
    result = inspect_dir(tmp_path / "d")
    assert not result.ok and any("conv and selector" in p for p in result.problems)


# ---------------------------------------------------------------------------- z-lab import
def zlab_v2_config(scales_at: str = "dflash_config") -> dict:
    """A hand-written z-lab DFlash 2 config.json (no training spec, no is_causal)."""
    cfg = make_config("zlab_default", **V2).to_dict()
    for key in (TRAINING_SPEC_KEY, "is_causal"):
        cfg.pop(key)
    cfg["dflash_config"].pop("causal")
    (cfg["dflash_config"] if scales_at == "dflash_config" else cfg).update(SCALES)
    return cfg


def test_zlab_dir_with_scales_reexports_with_every_scale_kept(tmp_path):
    config = make_config("zlab_default", **V2, **SCALES)
    d = write_zlab_dir(tmp_path / "zlab", zlab_v2_config(), random_state(config))
    imported = import_drafter(d)
    assert imported.config.variant == "dflash2" and imported.assumed_rules == "vllm-main-v2"
    assert {k: getattr(imported.config, k) for k in SCALES} == SCALES
    export_drafter(d, tmp_path / "re", engine="vllm", dtype="float32")
    out = json.loads((tmp_path / "re" / "config.json").read_text())
    assert {k: out["dflash_config"][k] for k in SCALES} == SCALES
    back = load_file(str(tmp_path / "re" / WEIGHTS_FILE))
    assert all(torch.equal(back[k], v) for k, v in load_file(str(d / WEIGHTS_FILE)).items())


def test_top_level_only_scales_are_dropped_by_engines_and_moved_by_reexport(tmp_path):
    """z-lab reads a scale at the top level too; both engines read dflash_config only."""
    config = make_config("zlab_default", **V2, **SCALES)
    d = write_zlab_dir(tmp_path / "zlab", zlab_v2_config("top"), random_state(config))
    readings = read_all(json.loads((d / "config.json").read_text()), Artifacts())
    assert set(readings["vllm-main-v2"].overrides) == {"output_multiplier",
                                                       "final_logit_softcapping",
                                                       "input_embedding_scale"}
    assert any("dflash_config only" in x for x in readings["sglang==0.5.23"].dropped)
    assert not inspect_dir(d, "vllm").ok
    export_drafter(d, tmp_path / "re", engine="vllm", dtype="float32")
    assert inspect_dir(tmp_path / "re", "vllm").ok
    out = json.loads((tmp_path / "re" / "config.json").read_text())
    assert {k: out["dflash_config"][k] for k in SCALES} == SCALES


def test_zlab_save_pretrained_codebook_names_are_read_and_flagged(tmp_path):
    config = make_config("zlab_default", **V2)
    state = random_state(config)
    suffixed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}
    d = write_zlab_dir(tmp_path / "zlab", zlab_v2_config(), suffixed)
    result = inspect_dir(d)
    assert "vllm-main-v2: NO, refuses to load: raises at weight loading" in result.text
    assert any("codebooks stay zero" in p for p in result.problems)
    imported = import_drafter(d)
    assert torch.equal(imported.state_dict["candidate_selector.successor_codebook"],
                       state["candidate_selector.successor_codebook"])
    assert any("renamed without '.weight'" in x for x in imported.disagreements)


_ZLAB_WRITER = """
import json, sys
import torch
from transformers import Qwen3Config
from dflash.model import DFlash2DraftModel
mode, path = sys.argv[1], sys.argv[2]
if mode == "write":
    cfg = Qwen3Config(**json.loads(sys.argv[3]))
    torch.manual_seed(0)
    model = DFlash2DraftModel(cfg)
    with torch.no_grad():  # base_kernel starts uninitialised (torch.empty) in z-lab's class
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
else:  # read: z-lab's loader on our re-export, its state_dict back out
    from safetensors.torch import save_file
    model = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[3])
"""


def _zlab(tmp_path: Path, *args: str) -> None:
    script = tmp_path / "zlab_io.py"
    script.write_text(_ZLAB_WRITER)
    done = subprocess.run([str(ZLAB_PYTHON), str(script), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not ZLAB_PYTHON.exists(),
                    reason="needs .venv-dflash (make dflash-venv): z-lab's dflash package")
def test_dir_written_by_zlab_code_imports_and_reexports_losslessly(tmp_path):
    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
             "vocab_size": 300, "max_position_embeddings": 512, "rope_theta": 1e6,
             "architectures": ["DFlash2DraftModel"], "num_target_layers": 6, "block_size": 4,
             "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 3], "block_size": 4,
                               **{k: v for k, v in V2.items() if k != "variant"}, **SCALES}}
    zdir, re_dir = tmp_path / "zlab", tmp_path / "re"
    _zlab(tmp_path, "write", str(zdir), json.dumps(shape))
    imported = import_drafter(zdir)
    assert imported.config.variant == "dflash2" and imported.config.input_embedding_scale == 1.5
    export_drafter(zdir, re_dir, engine="vllm", dtype="float32")
    theirs = json.loads((zdir / "config.json").read_text())
    ours = json.loads((re_dir / "config.json").read_text())
    # not written back: HF bookkeeping, and max_window_layers (28; ours is the layer count, the
    # same meaning when no layer slides); rope_parameters is compared as rope_theta below
    kept = set(theirs) - NOT_WRITTEN
    assert {k: ours[k] for k in kept if k != "dflash_config"} == \
        {k: theirs[k] for k in kept if k != "dflash_config"}
    assert {k: ours["dflash_config"][k] for k in theirs["dflash_config"]} == \
        theirs["dflash_config"]
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    # z-lab leaves causality implicit; the import resolved it (vllm-main-v2: bidirectional)
    assert dataclasses.replace(base_config(theirs, "z-lab"), is_causal=False) == \
        DrafterConfig.from_dict(ours)
    _zlab(tmp_path, "read", str(re_dir), str(tmp_path / "back.safetensors"))
    original = load_file(str(zdir / WEIGHTS_FILE))
    back = load_file(str(tmp_path / "back.safetensors"))  # z-lab's module names (".weight")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


# ---------------------------------------------------------------------------- vLLM's own code
def _pieces_module():
    from scripts import vllm_dflash2_pieces

    return vllm_dflash2_pieces


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make vllm-venv)")
def test_vllm_qwen3_dflash2_pieces_match_ours(tmp_path):
    """vLLM loads every tensor of our export; its CPU grouped conv, MLP sublayer, candidates
    and selector lattice give our numbers (float32)."""
    pieces = _pieces_module()
    case = pieces.prepare_case(tmp_path / "case")
    done = subprocess.run([str(VLLM_PYTHON), "-m", "scripts.vllm_dflash2_pieces", str(case)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = pieces.compare_case(case)
    assert result["passed"], result
    assert max(result["diffs"].values()) <= 1e-5
    assert result["load"]["num_tensors"] == len(expected_shapes(
        import_drafter(case / "export").config))
