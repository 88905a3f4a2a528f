"""target.head_only=true: embedding, final norm and LM head read straight from the safetensors
files (one file or sharded, tied or not, local dir or hub cache), everything else on meta, the
same identity as a full load (captures validate), and offline training on it."""

import json
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.targets.loader import load_target

PIECES = ("embed_tokens", "norm", "lm_head")


def _assert_same_head(full, head):
    fp, hp = full.pieces(), head.pieces()
    for name in PIECES:
        assert torch.equal(getattr(fp, name).weight, getattr(hp, name).weight), name
        assert not getattr(hp, name).weight.requires_grad
    assert head.identity() == full.identity()
    assert head.head_only and not full.head_only
    layer = head.model.base_model.layers[0].self_attn.q_proj.weight
    assert layer.device.type == "meta"  # the decoder was never loaded
    with pytest.raises(Exception):  # noqa: B017 (running a head-only target fails loudly)
        head.model(torch.tensor([[1, 2, 3]]))


def test_head_only_equals_the_full_load_on_the_tiny_target(tiny_target_dir):
    full = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    head = load_target(str(tiny_target_dir), dtype="float32", device="cpu", head_only=True)
    _assert_same_head(full, head)


def test_head_only_reads_sharded_tied_checkpoints_and_the_hub_cache(tmp_path, monkeypatch,
                                                                   tiny_target_dir):
    """A tied-embedding variant saved in ~20 shards, loaded from a directory and as a hub id
    from a local Hugging Face cache (snapshot layout, no network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    src = tmp_path / "tied"
    model.save_pretrained(src, max_shard_size="40KB")
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 5 and "lm_head.weight" not in index
    full = load_target(str(src), dtype="float32", device="cpu")
    _assert_same_head(full, load_target(str(src), dtype="float32", device="cpu",
                                        head_only=True))

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-tied" / "snapshots" / "0123abcd"
    shutil.copytree(src, snapshot)
    (cache / "models--acme--tiny-tied" / "refs").mkdir()
    (cache / "models--acme--tiny-tied" / "refs" / "main").write_text("0123abcd")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = load_target("acme/tiny-tied", dtype="float32", device="cpu", head_only=True)
    for name in PIECES:
        assert torch.equal(getattr(cached.pieces(), name).weight,
                           getattr(full.pieces(), name).weight)


def test_head_only_errors_name_the_problem_and_the_fix(tmp_path, tiny_target_dir):
    with pytest.raises(ValueError, match="not in the local Hugging Face cache|neither"):
        load_target("acme/never-downloaded", head_only=True)
    no_weights = tmp_path / "cfg_only"
    no_weights.mkdir()
    for f in tiny_target_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, no_weights / f.name)
    with pytest.raises(ValueError, match="needs safetensors weights"):
        load_target(str(no_weights), head_only=True)
    with pytest.raises(ValueError, match="GGUF"):
        load_target(str(tiny_target_dir), gguf_file="config.json", head_only=True)


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_offline_training_runs_on_a_head_only_target(tiny_target, tiny_target_dir, tmp_path):
    from dflash_lab.train.run import build_components, train

    rows = [{"messages": c} for c in demo_conversations(24, seed=4)]
    settings = CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=[1, 3, 5],
                               max_length=96, hidden_dtype="float32", batch_size=8)
    run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    common = ["target=hf", f"target.name_or_path={tiny_target_dir}", "target.dtype=float32",
              "target.device=cpu", "target.head_only=true", "drafter.target_layer_ids=[1,3,5]",
              "drafter.num_hidden_layers=1", "drafter.block_size=4", "logger=none",
              f"paths.output_dir={tmp_path / 'run'}", "trainer=cpu", "trainer.max_epochs=1",
              "data.batch_size=4", "data.num_workers=0", "module.num_anchors=8",
              "export.enabled=false"]
    result = train(_compose(common + ["data=offline", f"data.path={tmp_path / 'cap'}"]))
    assert result["val_tau_after"] >= 1.0 and result["best_checkpoint"]
    with pytest.raises(ValueError, match=r"online data \(.*\) runs the whole target"):
        build_components(_compose(common + ["data=online", "data.path=demo",
                                            f"data.demo_file={tmp_path / 'demo.jsonl'}"]))


def test_checkpoint_keys_match_across_language_model_prefixes(tmp_path):
    """A multimodal checkpoint's ``model.language_model.x`` is the causal LM's ``model.x``;
    a vision tower's tensor of the same short name does not count, two candidates refuse."""
    from dflash_lab.targets.head_only import checkpoint_key

    files = {k: tmp_path / "w.safetensors" for k in (
        "model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
        "model.visual.merger.norm.weight", "lm_head.weight", "mtp.norm.weight")}
    assert checkpoint_key(files, "lm_head.weight", tmp_path) == "lm_head.weight"
    assert (checkpoint_key(files, "model.embed_tokens.weight", tmp_path)
            == "model.language_model.embed_tokens.weight")
    assert (checkpoint_key(files, "model.norm.weight", tmp_path)
            == "model.language_model.norm.weight")
    with pytest.raises(ValueError, match="no such tensor.*head_only=false"):
        checkpoint_key(files, "model.final_layernorm.weight", tmp_path)
    files["language_model.model.norm.weight"] = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match="several candidates"):
        checkpoint_key(files, "model.norm.weight", tmp_path)
