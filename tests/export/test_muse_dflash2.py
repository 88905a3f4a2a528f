"""The DFlash 2 form of the Muse Glimmer assistant (formats/muse_glimmer.py ``DFLASH2_RELEASE``).

In released code it is z-lab's ``DFlash2DraftModel`` layout: z-lab's dflash 0.1.0 loads
``z-lab/Muse-Glimmer-30B-DFlash2`` with ``DFlash2DraftModel`` (``Qwen3Config``), vLLM 0.32 serves
it as ``DFlash2DraftModel``; transformers 5.25's ``muse_glimmer_assistant`` and vLLM's
``MuseGlimmerAssistantModel`` alias are DFlash 1 only. The fixture is written by z-lab's own
``DFlash2DraftModel(Qwen3Config(...)).save_pretrained`` (.venv-dflash) from the published
config.json's keys and values (tests/export_doubles.py ``MUSE_DFLASH2``) at the tiny target's
sizes, its codebooks named as the release names them (no ``.weight``: z-lab's
``from_pretrained`` maps ``candidate_selector.*_codebook`` to ``*.weight`` on load, which a
``save_pretrained`` file, already suffixed, would break), and z-lab's own ``from_pretrained``
is checked to read it back.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.export import export_drafter, import_drafter, inspect_dir
from dflash_lab.model.config import LayerSpec
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from tests.eval_doubles import cli_eval_report, demo_prompts
from tests.export_doubles import MUSE_DFLASH2, muse_dflash2_config

ZLAB_PYTHON = REPO_ROOT / ".venv-dflash" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not ZLAB_PYTHON.exists(),
    reason="needs .venv-dflash (make dflash-venv): z-lab's dflash package writes the fixture")

_ZLAB = """
import json, sys
import torch
from transformers import Qwen3Config
from dflash.model import DFlash2DraftModel
mode, path = sys.argv[1], sys.argv[2]
if mode == "write":
    torch.manual_seed(0)
    model = DFlash2DraftModel(Qwen3Config(**json.loads(sys.argv[3])))
    with torch.no_grad():  # z-lab leaves base_kernel uninitialised (torch.empty)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(path)
elif mode == "resave":  # z-lab's loader, then its save_pretrained, the release's names
    from safetensors.torch import load_file, save_file
    model = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(sys.argv[3])
    weights = f"{sys.argv[3]}/model.safetensors"
    save_file({k.removesuffix(".weight") if "_codebook" in k else k: v
               for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
else:  # read: z-lab's own loader, its state_dict back out
    from safetensors.torch import save_file
    model = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model, info = model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[3])
    print(json.dumps({k: sorted(v) for k, v in info.items() if k != "error_msgs"}))
"""


def zlab(tmp_path: Path, *args: str) -> str:
    """Run z-lab's writer / loader above in .venv-dflash; its stdout."""
    script = tmp_path / "zlab_muse2.py"
    script.write_text(_ZLAB)
    done = subprocess.run([str(ZLAB_PYTHON), str(script), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def write_muse_dflash2_dir(tmp_path: Path, path: Path, **sizes) -> Path:
    """The fixture: z-lab's save_pretrained of the published config, the release's names."""
    zlab(tmp_path, "write", str(path), json.dumps(muse_dflash2_config(**sizes)))
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    save_file({k.removesuffix(".weight") if "_codebook" in k else k: v
               for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    return path


def tiny_sizes(target) -> dict:
    return dict(hidden_size=target.model.config.hidden_size, vocab_size=target.vocab_size,
                mask_token_id=target.token_id("<|mask|>"), target_layer_ids=[1, 3, 5],
                num_target_layers=target.model.config.num_hidden_layers)


@pytest.fixture(scope="module")
def muse2(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muse2")
    return write_muse_dflash2_dir(tmp, tmp / "Muse-Glimmer-DFlash2", **tiny_sizes(tiny_target))


def test_zlabs_own_loader_reads_the_fixture(muse2, tmp_path):
    info = json.loads(zlab(tmp_path, "read", str(muse2), str(tmp_path / "back.safetensors")))
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    ours, back = load_file(str(muse2 / "model.safetensors")), load_file(
        str(tmp_path / "back.safetensors"))
    named = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in ours.items()}
    assert named.keys() == back.keys()
    assert all(torch.equal(named[k], back[k]) for k in named)


def test_import_reads_every_published_key(muse2, tiny_target):
    c = import_drafter(muse2).config
    published = MUSE_DFLASH2["dflash_config"]
    assert c.variant == "dflash2" and (c.conv_kernel_size, c.conv_group_size) == (2, 16)
    assert (c.selector_rank, c.selector_top_k) == (8, 4)  # sized down from 256, 16
    assert c.output_multiplier == published["output_multiplier"] == 0.19611613513818404
    assert c.final_logit_softcapping == published["final_logit_softcapping"] == 20.0
    assert c.layer_specs() == [LayerSpec(16, False)] * 2  # sliding, is_causal false
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (500000.0, 1e-5, None)
    assert (c.vocab_size, c.mask_token_id, c.block_size) == (
        tiny_target.vocab_size, tiny_target.token_id("<|mask|>"), 4)
    assert (c.target_layer_ids, c.num_target_layers) == ([1, 3, 5], 8)


def test_inspect_shows_the_engines_that_serve_it_as_trained(muse2):
    result = inspect_dir(muse2)
    assert result.readings["vllm-main-v2"].loads
    assert result.readings["sglang==0.5.23"].loads
    for name in ("vllm-main-v2", "sglang==0.5.23"):
        assert [(x.window, x.causal) for x in result.readings[name].layers] == [(16, False)] * 2
    # the known exception: SGLang's trtllm_mha backend bounds the bidirectional window at the
    # block end (engines/sglang.py BACKENDS)
    assert result.problems and all("trtllm_mha" in p for p in result.problems), result.problems


def test_dflash_eval_is_lossless(muse2, tiny_target_dir, tmp_path, monkeypatch):
    prompts = demo_prompts(tmp_path / "prompts.jsonl")
    report = cli_eval_report(monkeypatch, tiny_target_dir, muse2, prompts, tmp_path / "out")
    assert report["lossless"] is True and report["tau_mean"] >= 1.0
    assert report["settings"]["trained_block_size"] == 4


def test_init_from_holds_its_weights_and_drafts_as_the_import(muse2, tiny_target):
    from dflash_lab.train.factory import build_drafter
    from dflash_lab.train.warm_start import group_defaults

    drafter = build_drafter(tiny_target, backend="sdpa", init_from=str(muse2),
                            **group_defaults("dflash2")).eval()
    imported = import_drafter(muse2)
    assert drafter.config == imported.config  # _source is not compared
    reference = DFlashDrafter(imported.config).eval()
    reference.load_state_dict(imported.state_dict)
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in reference.state_dict().items())
    feats = torch.randn(1, 9, 3 * 64, generator=torch.Generator().manual_seed(3))
    pieces, proposals = tiny_target.pieces(), []
    for model in (drafter, reference):
        cache = model.new_cache()
        model.extend_context(cache, feats)
        hidden = model.draft(cache, torch.tensor([11]), pieces.embed_tokens)
        proposals.append(model.propose(hidden, torch.tensor([11]), pieces.lm_head))
    assert torch.equal(proposals[0], proposals[1])


def test_format_muse_glimmer_writes_the_release_layout_for_dflash2(muse2, tmp_path):
    """``--format muse-glimmer`` of a DFlash 2 drafter writes the released DFlash 2 Muse layout:
    every published key with the fixture's value (RoPE spelled rope_theta, read alike), the
    release's tensor names, and z-lab's own loader reads it back."""
    out = export_drafter(muse2, tmp_path / "out", engine="vllm", dtype="float32",
                         format="muse-glimmer").out_dir
    theirs = json.loads((muse2 / "config.json").read_text())
    ours = json.loads((out / "config.json").read_text())
    skipped = {"transformers_version", "dtype", "rope_parameters", "bos_token_id",
               "eos_token_id", "pad_token_id", "initializer_range", "use_cache"}
    assert {k: ours[k] for k in set(theirs) - skipped if k != "dflash_config"} == \
        {k: theirs[k] for k in set(theirs) - skipped if k != "dflash_config"}
    assert {k: ours["dflash_config"][k] for k in theirs["dflash_config"]} == \
        theirs["dflash_config"]
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    assert set(load_file(str(out / "model.safetensors"))) == set(
        load_file(str(muse2 / "model.safetensors")))
    report = (out / "EXPORT_REPORT.md").read_text()
    assert "muse-glimmer DFlash 2 (DFlash2DraftModel, the layout of " \
           "z-lab/Muse-Glimmer-30B-DFlash2" in report
    info = json.loads(zlab(tmp_path, "read", str(out), str(tmp_path / "back.safetensors")))
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
