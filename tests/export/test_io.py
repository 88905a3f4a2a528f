"""Export -> files -> import round trips, sources, atomic output, self-check and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_lab.export import (
    ExportRefused,
    SelfCheckFailed,
    export_drafter,
    import_drafter,
    inspect_dir,
    load_serving_dir,
)
from dflash_lab.export.api import serving_config
from dflash_lab.export.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, main
from dflash_lab.export.engines import RuleSet, get_rule_set
from dflash_lab.export.engines.common import Artifacts, LayerReading
from dflash_lab.export.selfcheck import run_self_check
from dflash_lab.export.weights import MASK_KEY, Source, expected_shapes, load_weights
from dflash_lab.model.config import TRAINING_SPEC_KEY
from tests.export_doubles import (
    make_config,
    random_state,
    write_checkpoint,
    write_zlab_dir,
    zlab_config,
)


def source(layout: str, **kw) -> Source:
    config = make_config(layout, **kw)
    return Source(config, random_state(config), "checkpoint", f"test {layout}")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_expected_shapes_match_the_real_drafter():
    drafter_mod = pytest.importorskip("dflash_lab.model.drafter")
    for layout in ("zlab_default", "mimo"):
        config = make_config(layout, attention_bias=True)
        state = drafter_mod.DFlashDrafter(config).state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items() if k != MASK_KEY}
        assert shapes == expected_shapes(config)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", ["zlab_default", "all_sliding_causal", "gemma_mixed", "mimo"])
def test_round_trip_bit_identical(tmp_path, layout, dtype):
    src = source(layout)
    out = tmp_path / "out"
    export_drafter(src, out, engine="vllm", dtype=dtype)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "EXPORT_REPORT.md", "SHA256SUMS"]
        + (["mask_embedding.pt"] if layout == "mimo" else []))
    assert json.loads((out / "config.json").read_text()) == serving_config(src.config, dtype)
    config, state, mask = load_serving_dir(out)
    assert config.layer_specs() == src.config.layer_specs() and config == src.config
    want = {k: v.to(getattr(torch, dtype)) for k, v in src.state_dict.items()}
    assert state.keys() == want.keys()
    for k in want:
        assert state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]), k
    assert (mask is not None) == (layout == "mimo")
    assert not leftovers(tmp_path)


def test_mask_embedding_file_is_the_vllm_dict_form(tmp_path):
    src = source("mimo")
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    data = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert data["mask_token_id"] == 7 and torch.equal(data["embedding"],
                                                      src.state_dict[MASK_KEY])
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k
                   for k in load_weights(tmp_path / "out"))


def test_round_trip_gives_identical_drafter_logits(tmp_path):
    drafter_mod = pytest.importorskip("dflash_lab.model.drafter")
    src = source("gemma_mixed")
    export_drafter(src, tmp_path / "out", engine="both", dtype="float32")
    config, state, _ = load_serving_dir(tmp_path / "out")
    feats = torch.randn(1, 20, 3 * 32)
    embed = torch.nn.Embedding(300, 32)
    outs = []
    for cfg, sd in ((src.config, src.state_dict), (config, state)):
        drafter = drafter_mod.DFlashDrafter(cfg).eval()
        drafter.load_state_dict(sd)
        cache = drafter.new_cache()
        drafter.extend_context(cache, feats)
        outs.append(drafter.draft(cache, torch.tensor([5]), embed))
    assert torch.equal(outs[0], outs[1])


def test_report_has_layer_table_and_self_check(tmp_path):
    export_drafter(source("gemma_mixed"), tmp_path / "out", dtype="bfloat16")
    report = (tmp_path / "out" / "EXPORT_REPORT.md").read_text()
    assert "| layer | trained | vllm-main-v1 | vllm-main-v2 |" in report
    assert "| 2 | full bidir |" in report
    assert "-> ok" in report and "VLLM_USE_V2_MODEL_RUNNER=1" in report


# ---------------------------------------------------------------------------- sources
def test_export_from_lightning_checkpoint(tmp_path):
    config = make_config("all_sliding_causal")
    ckpt = write_checkpoint(tmp_path / "run" / "x.ckpt", config, random_state(config))
    export_drafter(ckpt, tmp_path / "out", dtype="float32")
    assert import_drafter(tmp_path / "out").config == config


def test_checkpoint_of_compiled_layers(tmp_path):
    config = make_config("zlab_default")
    state = {k.replace("self_attn.", "_orig_mod.self_attn.").replace("mlp.", "_orig_mod.mlp."): v
             for k, v in random_state(config).items()}
    ckpt = write_checkpoint(tmp_path / "c.ckpt", config, state)
    export_drafter(ckpt, tmp_path / "out", dtype="float32")
    assert "layers.0.self_attn.q_proj.weight" in load_weights(tmp_path / "out")


def test_run_dir_uses_best_json(tmp_path):
    config = make_config("zlab_default")
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "epoch=1.ckpt", config, random_state(config, 1))
    write_checkpoint(run / "checkpoints" / "last.ckpt", config, random_state(config, 2))
    (run / "checkpoints" / "best.json").write_text(
        json.dumps({"path": "checkpoints/epoch=1.ckpt", "val/tau": 3.2}))
    export_drafter(run, tmp_path / "out", dtype="float32")
    got = load_weights(tmp_path / "out")
    assert torch.equal(got["fc.weight"], random_state(config, 1)["fc.weight"])
    assert "val/tau=3.2" in (tmp_path / "out" / "EXPORT_REPORT.md").read_text()


def test_run_dir_falls_back_to_last_with_warning(tmp_path, capsys):
    config = make_config("zlab_default")
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "last.ckpt", config, random_state(config, 2))
    export_drafter(run, tmp_path / "out", dtype="float32")
    assert "best.json is missing" in capsys.readouterr().err


def test_checkpoint_with_pickled_objects_is_rejected(tmp_path):
    config = make_config("zlab_default")
    ckpt = write_checkpoint(tmp_path / "bad.ckpt", config, random_state(config),
                            extra_hparams={"fn": Path("x")})
    with pytest.raises(ValueError, match="weights_only=True"):
        export_drafter(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_wrong_weights_is_rejected(tmp_path):
    config = make_config("zlab_default")
    state = random_state(config)
    state.pop("norm.weight")
    ckpt = write_checkpoint(tmp_path / "bad.ckpt", config, state)
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        export_drafter(ckpt, tmp_path / "out")


def test_reexport_from_serving_dir_is_identical(tmp_path):
    export_drafter(source("mimo"), tmp_path / "a", engine="vllm", dtype="float32")
    export_drafter(tmp_path / "a", tmp_path / "b", engine="vllm", dtype="float32")
    assert (tmp_path / "a" / "config.json").read_text() == \
        (tmp_path / "b" / "config.json").read_text()


# ---------------------------------------------------------------------------- safety
def test_refusal_leaves_nothing_behind(tmp_path):
    with pytest.raises(ExportRefused, match="block-end"):  # SGLang's trtllm_mha window
        export_drafter(source("mimo"), tmp_path / "out", engine="both")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        export_drafter(source("zlab_default"), out)
    assert (out / "keep.txt").exists()
    with pytest.raises(FileExistsError, match="not replaced"):  # not a previous export
        export_drafter(source("zlab_default"), out, force=True, dtype="float32")
    (out / "keep.txt").unlink()
    export_drafter(source("zlab_default"), out, force=True, dtype="float32")
    export_drafter(source("zlab_default"), out, force=True, dtype="float32")
    assert (out / "config.json").exists() and not leftovers(tmp_path)


def test_refusal_with_force_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    export_drafter(source("zlab_default"), out, dtype="float32")
    before = (out / "config.json").read_text()
    with pytest.raises(ExportRefused):
        export_drafter(source("illegal_mixed"), out, force=True)
    assert (out / "config.json").read_text() == before and not leftovers(tmp_path)


def _flipping(name: str) -> RuleSet:
    """A rule set that misreads every layer's causality (what a silent engine bug looks like)."""
    real = get_rule_set(name)

    def read(config, artifacts):
        reading = real.read(config, artifacts)
        reading.layers = [LayerReading(r.window, not r.causal, r.bidir_window)
                          for r in reading.layers]
        return reading
    return RuleSet(name, real.engine, True, read, "test")


def test_self_check_catches_a_misread_layout(tmp_path):
    src = source("gemma_mixed")
    export_drafter(src, tmp_path / "out", engine="vllm", dtype="float32")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    args = (tmp_path / "out", raw, src.config, src.state_dict)
    good, _ = run_self_check(*args, [get_rule_set("vllm-main-v2")], Artifacts(), torch.float32)
    assert good[0].ok and good[0].config_diff < 1e-6
    bad, _ = run_self_check(*args, [_flipping("vllm-main-v2")], Artifacts(), torch.float32)
    assert bad[0].config_diff > 1e-3 and bad[0].faithful is False


def test_self_check_failure_writes_nothing(tmp_path, monkeypatch):
    import dflash_lab.export.api as api

    monkeypatch.setattr(api, "run_self_check", lambda *a, **k: (
        [type("R", (), {"ok": False, "line": lambda self: "- forced failure"})()], "test"))
    with pytest.raises(SelfCheckFailed, match="forced failure"):
        export_drafter(source("zlab_default"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_bf16_self_check_within_tolerance(tmp_path):
    result = export_drafter(source("mimo"), tmp_path / "out", engine="vllm", dtype="bfloat16")
    assert result.self_check and all(r.ok and r.faithful for r in result.self_check)
    assert all(r.total_diff > 0 for r in result.self_check)  # bf16 rounding is visible


# ---------------------------------------------------------------------------- z-lab import
def _zlab_dir(tmp_path: Path, style: str) -> Path:
    cfg = make_config("mimo") if style == "mimo" else make_config("zlab_default")
    state = random_state(cfg)
    mask = state.pop(MASK_KEY, None)
    return write_zlab_dir(tmp_path / style, zlab_config(style), state, mask)


def test_import_zlab_qwen3_style_records_assumed_rules(tmp_path):
    imported = import_drafter(_zlab_dir(tmp_path, "qwen3_8b"))
    assert imported.assumed_rules == "vllm-main-v2" and imported.disagreements == []
    assert imported.config.layer_specs() == make_config("zlab_default").layer_specs()
    assert "vllm-main-v2" in imported.config._source


def test_import_zlab_gemma_style_lists_disagreeing_rule_sets(tmp_path):
    d = _zlab_dir(tmp_path, "gemma4")
    imported = import_drafter(d)
    assert imported.config.layer_specs() == make_config("gemma_mixed").layer_specs()
    assert any("sglang#34262..#34524" in x for x in imported.disagreements)
    by_sglang = import_drafter(d, assume="sglang#34262..#34524")
    assert [s.causal for s in by_sglang.config.layer_specs()] == [False] * 3


def test_import_zlab_mimo_style_keeps_mask_and_sinks_for_vllm(tmp_path):
    imported = import_drafter(_zlab_dir(tmp_path, "mimo"))
    assert imported.config.learned_mask_embedding and imported.config.attention_sink_bias
    assert imported.mask_embedding is not None and MASK_KEY in imported.state_dict
    assert [s.window for s in imported.config.layer_specs()] == [8] * 3
    as_old_sglang = import_drafter(tmp_path / "mimo", assume="sglang#34524")
    assert not as_old_sglang.config.attention_sink_bias and as_old_sglang.mask_embedding is None


# ---------------------------------------------------------------------------- inspect + CLI
@pytest.mark.parametrize(("style", "ok"), [("qwen3_8b", True), ("gemma4", False), ("mimo", False)])
def test_inspect_zlab_dirs(tmp_path, style, ok, capsys):
    d = _zlab_dir(tmp_path, style)
    assert inspect_dir(d).ok is ok
    assert main(["--inspect", str(d)]) == (EXIT_OK if ok else EXIT_REFUSED)
    text = capsys.readouterr().out
    assert "| layer | vllm-main-v1 |" in text


def test_inspect_flags_seed_regression_on_our_gemma_export(tmp_path):
    """gemma-4 style checkpoint, implicit causality, SGLang #34262..#34524 -> flagged."""
    export_drafter(source("gemma_mixed"), tmp_path / "out", dtype="float32")
    result = inspect_dir(tmp_path / "out", "sglang")
    assert not result.ok
    assert any("sglang#34262..#34524" in p and "layer 0" in p for p in result.problems)
    assert inspect_dir(tmp_path / "out", "vllm").ok


def _vllm_only_export(tmp_path: Path) -> Path:
    """A draft-vocabulary drafter (50 of 300 tokens: SGLang drafts over the whole vocabulary,
    so it cannot serve it) exported with --engine vllm."""
    config = make_config("zlab_default", draft_vocab_size=50)
    state, ids = random_state(config), torch.arange(50) * 2
    state["d2t"], state["t2d"] = ids - torch.arange(50), torch.zeros(300, dtype=torch.bool)
    state["t2d"][ids] = True
    ckpt = write_checkpoint(tmp_path / "v.ckpt", config, state)
    assert main([str(ckpt), str(tmp_path / "out"), "--engine", "vllm", "--dtype",
                 "float32"]) == EXIT_OK
    return tmp_path / "out"


def test_inspect_judges_an_export_for_the_engines_it_was_made_for(tmp_path, capsys):
    """Issue 47: a vLLM-only export said "NOT OK: 6 problems", exit 3. The engines are read
    from its report; SGLang's findings are notes; --engine chooses."""
    out = _vllm_only_export(tmp_path)
    capsys.readouterr()
    assert main(["--inspect", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "judged for: vllm (the export was made for them (EXPORT_REPORT.md" in text
    notes = text.split("Notes (engines it is not judged for, not problems):")[1]
    assert "sglang==0.5.23 silently drops draft_vocab_size=50" in notes.split("Problems:")[0]
    assert text.split("Problems:")[1].startswith("\n- none")
    assert text.rstrip().endswith("OK: every rule set of vllm (the engines judged; the others: "
                                  "Notes) runs the same drafter")
    for engine in ("sglang", "both"):
        assert main(["--inspect", str(out), "--engine", engine]) == EXIT_REFUSED
        assert f"judged for: {'sglang' if engine == 'sglang' else 'vllm, sglang'} (chosen " \
            "with --engine)" in capsys.readouterr().out
    assert len(inspect_dir(out, "sglang").problems) == 6


def test_inspect_without_a_record_of_the_engines_judges_both(tmp_path):
    """Another tool's directory (or an older export without the report): every engine."""
    out = _vllm_only_export(tmp_path)
    (out / "EXPORT_REPORT.md").unlink()
    result = inspect_dir(out, verify=False)
    assert not result.ok and len(result.problems) == 6 and not result.notes
    assert "judged for: vllm, sglang (no EXPORT_REPORT.md record" in result.text


def test_inspect_compares_with_recorded_training_spec(tmp_path):
    export_drafter(source("zlab_default"), tmp_path / "out", dtype="float32")
    assert inspect_dir(tmp_path / "out").ok
    cfg_file = tmp_path / "out" / "config.json"
    d = json.loads(cfg_file.read_text())
    d.pop("is_causal")
    d["dflash_config"].pop("causal")
    d[TRAINING_SPEC_KEY]["layer_specs"] = [{"window": None, "causal": True}] * 3
    d[TRAINING_SPEC_KEY]["is_causal"] = True
    cfg_file.write_text(json.dumps(d))
    problems = inspect_dir(tmp_path / "out").problems
    assert any("trained as 'full causal'" in p for p in problems)


def test_cli_export_and_exit_codes(tmp_path, capsys):
    config = make_config("mimo")
    ckpt = write_checkpoint(tmp_path / "m.ckpt", config, random_state(config))
    out = tmp_path / "out"
    assert main([str(ckpt), str(out)]) == EXIT_REFUSED
    assert "trtllm_mha" in capsys.readouterr().err and not out.exists()
    assert main([str(ckpt), str(out), "--engine", "vllm", "--dtype", "float32"]) == EXIT_OK
    assert main([str(ckpt), str(out), "--engine", "vllm"]) == EXIT_USAGE  # exists, no --force
    assert main([str(ckpt), str(out), "--allow_lossy", "--force"]) == EXIT_OK
    assert "ALLOWED LOSSY" in (out / "EXPORT_REPORT.md").read_text()
    assert main([str(tmp_path / "nothing"), str(tmp_path / "o2")]) == EXIT_USAGE


def test_cli_target_check(tmp_path):
    config = make_config("zlab_default")
    ckpt = write_checkpoint(tmp_path / "m.ckpt", config, random_state(config))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 6}))
    args = [str(ckpt), str(tmp_path / "out"), "--target", str(tmp_path / "target")]
    assert main(args) == EXIT_REFUSED and not (tmp_path / "out").exists()
