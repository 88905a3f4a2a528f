"""Faults and hostile inputs (issue 16): what must never happen, whatever the input."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.paths import CONF_DIR


class _Payload:
    """Unpickling this object creates a file: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_never_runs_a_pickle_payload(tmp_path, tiny_target_dir, monkeypatch):
    """``ckpt_path=auto`` loads last.ckpt with weights_only=True explicitly, so even
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 cannot make a planted checkpoint execute code."""
    from dflash_lab.train.run import train

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, run / "checkpoints" / "last.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "recipe=tiny_cpu", f"target.path={tiny_target_dir}", f"paths.output_dir={run}",
            "logger=none", "export.enabled=false", "data.demo_rows=24",
            f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=64"])
    with pytest.raises(Exception, match="(?i)weights.only"):
        train(cfg)
    assert not marker.exists()


# ------------------------------------------------------------- item 3: the target's weights
def _other_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the target directory whose weights are all nudged (a fine-tune's shape:
    same config, tokenizer and tensor shapes, other values)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def weights_capture(tiny_target, tiny_target_dir, tmp_path_factory):
    """A 4-row capture of the tiny target and a loaded other checkpoint of the same config."""
    from dflash_lab.data.capture_loop import CaptureSettings, run_capture
    from dflash_lab.data.demo_corpus import demo_conversations
    from dflash_lab.target.loader import load_target

    root = tmp_path_factory.mktemp("weights")
    rows = [{"messages": c} for c in demo_conversations(4, seed=3)]
    settings = CaptureSettings(out_dir=str(root / "cap"), target_layer_ids=[1, 3],
                               shard_size=4, batch_size=4, max_length=48)
    run_capture(tiny_target, rows, settings, {"path": "demo"}, progress=False)
    other = load_target(str(_other_checkpoint(tiny_target_dir, root / "other")),
                        dtype="float32", device="cpu", head_only=True)
    return root / "cap", other


def test_capture_of_another_checkpoint_is_refused_naming_both_fingerprints(
        tiny_target, weights_capture):
    from dflash_lab.data.shards import ShardDataset

    cap, other = weights_capture
    mine, theirs = tiny_target.weights_fingerprint(), other.weights_fingerprint()
    assert mine and theirs and mine != theirs
    with pytest.raises(ValueError, match=f"(?s){mine[:16]}.*{theirs[:16]}.*"
                                         "allow_other_target_weights=true"):
        ShardDataset(cap, target=other.identity())
    assert len(ShardDataset(cap, target=other.identity(), allow_other_weights=True)) == 4
    assert len(ShardDataset(cap, target=tiny_target.identity())) == 4


def test_manifest_without_a_fingerprint_warns_and_is_used(tiny_target, weights_capture,
                                                          tmp_path, caplog):
    import json
    import shutil

    from dflash_lab.data.shards import ShardDataset

    old = tmp_path / "old"
    shutil.copytree(weights_capture[0], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["target"]["weights_fingerprint"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        assert len(ShardDataset(old, target=tiny_target.identity())) == 4
    assert "no target weights fingerprint" in caplog.text


def test_fingerprint_is_one_for_full_head_only_and_hub_cache_loads(
        tiny_target, tiny_target_dir, offline_hf_cache):
    from stand_ins import publish_to_hf_cache

    from dflash_lab.target.loader import load_target

    publish_to_hf_cache(tiny_target_dir, "Org/Tiny", offline_hf_cache)
    loads = [load_target(str(tiny_target_dir), dtype="float32", device="cpu", head_only=True),
             load_target("Org/Tiny", dtype="float32", device="cpu", head_only=True),
             load_target("Org/Tiny", dtype="float32", device="cpu")]
    want = tiny_target.weights_fingerprint()
    assert want is not None
    assert [t.weights_fingerprint() for t in loads] == [want] * 3


# ------------------------------------------------------------------ item 8: corrupt bytes
def test_a_flipped_byte_in_a_shard_is_an_error_naming_it_by_default(weights_capture,
                                                                    tmp_path):
    """Default ``verify_checksums=first_use``: the shard's sha256 is checked when a process
    first reads it (same size, so only the hash can tell)."""
    import shutil

    from dflash_lab.data.shards import ShardDataset

    cap = tmp_path / "cap"
    shutil.copytree(weights_capture[0], cap)
    shard = cap / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data, past the header
    shard.write_bytes(bytes(data))
    ds = ShardDataset(cap)
    with pytest.raises(ValueError, match="shard-00000.safetensors: checksum mismatch"):
        ds[0]
    with pytest.raises(ValueError, match="shard-00000.safetensors: checksum mismatch"):
        ShardDataset(cap, verify_checksums=True)
    assert ShardDataset(cap, verify_checksums=False)[0]["sample_id"] >= 0
