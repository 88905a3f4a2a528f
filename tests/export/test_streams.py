"""``target_hidden_size`` in the serving formats: how vLLM and SGLang size ``fc`` from it (the rule
sets of engines/streams.py, and vLLM's own ``_get_dflash_fc_input_size``), the export's refusal
and ``--allow_lossy``, export -> import -> the same drafts, the z-lab/vLLM-style and speculators
readers, and the ``--target`` check against a multi-stream target's config."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from dflash_lab.export import load_source
from dflash_lab.export.api import ExportRefused, export_drafter, inspect_dir, plan_export
from dflash_lab.export.checks import check_target, refusals
from dflash_lab.export.engines import Artifacts
from dflash_lab.export.formats import read_all
from dflash_lab.export.weights import Source
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from tests.export_doubles import make_config, random_state, write_zlab_dir, zlab_config

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
H, N = 32, 4  # BASE hidden size; streams of the pretend multi-stream target
WIDE = N * H  # its flattened streams


def _wide(**overrides):
    return make_config("zlab_default", target_hidden_size=WIDE, **overrides)


def test_the_engines_serve_the_stream_mean_and_refuse_the_flattened_streams():
    plain = read_all(make_config("zlab_default").to_dict(), Artifacts())
    assert all(r.loads for r in plain.values())
    for name, reading in read_all(_wide().to_dict(), Artifacts()).items():
        assert not reading.loads, name
        if name.startswith("vllm-main"):  # qwen3_dflash.py sizes fc from it, targets feed H
            assert "fc [32, 3 x 128] from target_hidden_size=128" in reading.refusal
            assert "first draft step" in reading.refusal
        elif name.startswith("vllm"):
            assert "cannot run the checkpoint's fc [32, 3 x 128]" in reading.refusal
            assert "feed 32 per layer" in reading.refusal
        else:  # srt/models/dflash.py: fc from hidden_size only
            assert "never reads target_hidden_size=128" in reading.refusal
            assert "[32, 3 x 32]" in reading.refusal


def test_the_export_refuses_unless_lossy_is_allowed(tmp_path):
    config = _wide()
    for engine in ("vllm", "sglang"):
        _, findings = plan_export(config, (engine,))
        assert any("target_hidden_size=128" in f.message for f in refusals(findings)), engine
    source = Source(config, random_state(config), "checkpoint", "wide")
    with pytest.raises(ExportRefused, match="target_hidden_size=128"):
        export_drafter(source, tmp_path / "refused", engine="vllm", dtype="float32")
    assert not (tmp_path / "refused").exists()


def _drafts(drafter: DFlashDrafter, seed: int = 0) -> torch.Tensor:
    """Block hidden states for two anchors after a 7-position context (float32)."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, 7, drafter.config.num_features, generator=gen)
    embed = torch.nn.Embedding(drafter.config.vocab_size, drafter.config.hidden_size)
    torch.nn.init.normal_(embed.weight, generator=gen)
    cache = drafter.new_cache()
    drafter.extend_context(cache, feats)
    return drafter.draft(cache, torch.tensor([5]), embed)


@pytest.mark.parametrize("width", [H, WIDE])
def test_export_import_gives_the_same_drafter_and_drafts(tmp_path, width):
    config = make_config("zlab_default", target_hidden_size=width)
    state = random_state(config)
    out = tmp_path / "export"
    export_drafter(Source(config, state, "checkpoint", "t"), out, engine="both", dtype="float32",
                   allow_lossy=width != H)
    written = json.loads((out / "config.json").read_text())
    assert written.get("target_hidden_size") == (WIDE if width == WIDE else None)
    back = load_source(out)
    assert back.config == config and back.config.num_features == 3 * width
    assert set(back.state_dict) == set(state)
    assert all(torch.equal(back.state_dict[k], state[k]) for k in state)
    assert back.state_dict["fc.weight"].shape == (H, 3 * width)
    original, imported = DFlashDrafter(config).eval(), DFlashDrafter(back.config).eval()
    original.load_state_dict(state, strict=False)
    imported.load_state_dict(back.state_dict, strict=False)
    with torch.no_grad():
        assert torch.equal(_drafts(original), _drafts(imported))
    text = inspect_dir(out).text
    assert f"fc reads 3 target layers x {width} = {3 * width}" in text
    assert ("flattened streams" in text) == (width == WIDE)


def test_a_vllm_style_config_declaring_the_width_is_read():
    from dflash_lab.export.engines.zlab import base_config

    d = zlab_config("qwen3_8b")
    assert base_config(d, "z-lab").target_hidden_size == H
    d["target_hidden_size"] = WIDE
    assert base_config(d, "z-lab").num_features == 3 * WIDE


def test_a_third_party_directory_with_the_flattened_streams_imports(tmp_path):
    d = {**zlab_config("qwen3_8b"), "target_hidden_size": WIDE}
    config = make_config("zlab_default", target_hidden_size=WIDE, num_target_layers=6,
                         target_layer_ids=[1, 2, 3])
    state = random_state(config)
    write_zlab_dir(tmp_path / "zlab", d, state)
    src = load_source(tmp_path / "zlab")
    assert src.config.target_hidden_size == WIDE
    assert torch.equal(src.state_dict["fc.weight"], state["fc.weight"])
    report = inspect_dir(tmp_path / "zlab", verify=False)  # how each engine would read it
    assert report.problems == ["no rule set loads this directory"]
    assert "vllm-main-v2: NO, refuses to load: loads, then fails at the first draft step" in \
        report.text
    assert "sglang==0.5.23: NO, refuses to load: raises at weight loading" in report.text


def test_speculators_config_target_hidden_size_is_read_not_refused(tmp_path, tiny_target):
    """speculators' DFlashSpeculatorConfig.target_hidden_size (vLLM's update_dflash copies it):
    read as the fc width; the weights must then be that wide."""
    from dflash_lab.export.formats.speculators import speculators_config
    from tests.train.test_warm_start import speculators_dict, tiny_source_config

    config = tiny_source_config(tiny_target)
    d = speculators_dict(config)
    assert speculators_config(d, tmp_path / "config.json")[0].target_hidden_size == \
        config.hidden_size
    d["target_hidden_size"] = 4 * config.hidden_size
    read, _ = speculators_config(d, tmp_path / "config.json")
    assert read.target_hidden_size == 4 * config.hidden_size
    assert read.num_features == len(config.target_layer_ids) * 4 * config.hidden_size


def test_target_check_accepts_the_widths_a_multi_stream_target_gives():
    target = {"model_type": "deepseek_v4", "hidden_size": H, "vocab_size": 300,
              "num_hidden_layers": 6, "hc_mult": N}
    for width in (H, WIDE):
        config = make_config("zlab_default", target_hidden_size=width)
        assert check_target(config, target) == []
    bad = check_target(make_config("zlab_default", target_hidden_size=2 * H), target)
    assert len(bad) == 1 and not bad[0].lossy
    assert "target_hidden_size=64" in bad[0].message and "[32, 128]" in bad[0].message
    plain = check_target(_wide(), {k: v for k, v in target.items() if k != "hc_mult"})
    assert len(plain) == 1 and "1 stream(s)" in plain[0].message


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make vllm-venv)")
def test_vllm_sizes_fc_from_our_exported_target_hidden_size(tmp_path):
    """vLLM 0.32's own _get_dflash_fc_input_size on our exports: 3 x T, T from the written key
    (absent = hidden_size); its speculators converter keeps the key."""
    paths = []
    for width in (H, WIDE):
        config = make_config("zlab_default", target_hidden_size=width)
        out = tmp_path / f"w{width}"
        export_drafter(Source(config, random_state(config), "checkpoint", "t"), out,
                       engine="vllm", dtype="float32", allow_lossy=True)
        spec = tmp_path / f"spec{width}.json"
        spec.write_text(json.dumps({"aux_hidden_state_layer_ids": [2, 3, 4],
                                    "mask_token_id": 7, "target_hidden_size": width}))
        paths += [str(out), str(spec)]
    done = subprocess.run([str(VLLM_PYTHON), "-m", "scripts.vllm_fc_width", *paths],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert [got[p] for p in paths] == [3 * H, H, 3 * WIDE, WIDE]
