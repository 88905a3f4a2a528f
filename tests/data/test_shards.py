"""The shard format on synthetic samples (no target): round trip, manifest, validation errors."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_lab.data import shards
from dflash_lab.data.capture_loop import claim_dir, shards_for_rank
from dflash_lab.data.conversations import load_conversations

D = 12


def _samples(n: int, seed: int = 0) -> list[shards.CapturedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        s = 3 + k
        out.append(shards.CapturedSample(
            sample_id=10 + k, input_ids=torch.randint(0, 500, (s,), generator=g),
            loss_mask=torch.rand(s, generator=g) > 0.5,
            hidden=torch.randn(s, D, generator=g).to(torch.bfloat16),
            target_argmax=torch.randint(0, 500, (s,), generator=g)))
    return out


def _capture_dir(tmp_path, counts=(3, 0, 2)):
    plan = {"target": {"vocab_size": 500, "config_hash": "c", "tokenizer_hash": "t"},
            "target_layer_ids": [1, 2], "hf_hidden_state_indices": [2, 3], "hidden_size": 6,
            "feature_dim": D,
            "num_input_rows": 8, "num_shards": len(counts)}
    claim_dir(tmp_path, plan)
    written = []
    for i, n in enumerate(counts):
        samples = _samples(n, seed=i)
        shards.write_shard(tmp_path, i, samples, "bfloat16", feature_dim=D)
        written.extend(samples)
    return shards.merge_manifest(tmp_path), written


def test_round_trip_is_exact_and_ordered(tmp_path):
    manifest, written = _capture_dir(tmp_path)
    assert manifest["num_samples"] == 5 and manifest["num_dropped"] == 3
    ds = shards.ShardDataset(tmp_path, verify_checksums=True)
    assert len(ds) == 5
    for item, ref in zip(ds, written):
        assert item["sample_id"] == ref.sample_id
        assert torch.equal(item["input_ids"], ref.input_ids)
        assert torch.equal(item["loss_mask"], ref.loss_mask)
        assert torch.equal(item["hidden"], ref.hidden) and item["hidden"].dtype == torch.bfloat16
        assert torch.equal(item["target_argmax"], ref.target_argmax)


def test_manifest_waits_for_missing_shards(tmp_path):
    claim_dir(tmp_path, {"num_input_rows": 2, "num_shards": 2})
    shards.write_shard(tmp_path, 0, _samples(1), "bfloat16")
    assert shards.merge_manifest(tmp_path) is None
    assert not (tmp_path / shards.MANIFEST_FILE).exists()


def test_expectations_are_checked_with_both_values(tmp_path):
    _capture_dir(tmp_path)
    shards.ShardDataset(tmp_path, target_layer_ids=[1, 2], hidden_size=6, vocab_size=500)
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 2\] but \[1, 3\]"):
        shards.ShardDataset(tmp_path, target_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="hidden_size=6 but 8"):
        shards.ShardDataset(tmp_path, hidden_size=8)
    with pytest.raises(ValueError, match="vocab_size=500 but 501"):
        shards.ShardDataset(tmp_path, vocab_size=501)
    with pytest.raises(ValueError, match="target.tokenizer_hash='t' but 'x'"):
        shards.ShardDataset(tmp_path, target={"config_hash": "c", "tokenizer_hash": "x"})


def test_format_version_and_missing_manifest(tmp_path):
    with pytest.raises(ValueError, match="no manifest"):
        shards.ShardDataset(tmp_path)
    _capture_dir(tmp_path)
    path = tmp_path / shards.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99"):
        shards.ShardDataset(tmp_path)


def _edit_manifest(tmp_path, **fields):
    path = tmp_path / shards.MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=1))


def test_a_manifest_whose_layer_conventions_disagree_is_refused(tmp_path):
    """Issue 47: target_layer_ids edited (hf_hidden_state_indices left) trained without a word;
    now refused naming the file, both fields and the fix, which works."""
    _capture_dir(tmp_path)
    _edit_manifest(tmp_path, target_layer_ids=[1, 3])
    with pytest.raises(ValueError, match=r"manifest.json: target_layer_ids=\[1, 3\] and "
                       r"hf_hidden_state_indices=\[2, 3\] disagree.*rerun dflash-capture"):
        shards.ShardDataset(tmp_path)
    shards.merge_manifest(tmp_path)  # what rerunning dflash-capture on the out_dir does
    assert shards.ShardDataset(tmp_path).manifest["target_layer_ids"] == [1, 2]


def test_an_edited_manifest_fails_its_own_checksum(tmp_path):
    manifest, _ = _capture_dir(tmp_path)
    assert manifest[shards.SEAL_KEY] == shards.read_manifest(tmp_path)[shards.SEAL_KEY]
    _edit_manifest(tmp_path)  # re-indented only: still the same record
    shards.ShardDataset(tmp_path)
    _edit_manifest(tmp_path, hidden_dtype="float16")
    with pytest.raises(ValueError, match=r"manifest.json: its fields no longer match its "
                                         r"manifest_sha256 .*capture.out_dir="):
        shards.ShardDataset(tmp_path)


def test_a_manifest_from_before_the_seal_is_read_with_a_warning(tmp_path, caplog):
    manifest, _ = _capture_dir(tmp_path)
    manifest.pop(shards.SEAL_KEY)
    (tmp_path / shards.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert len(shards.ShardDataset(tmp_path)) == 5
    assert "no manifest_sha256 (a capture from before manifests were sealed)" in caplog.text


def test_truncated_and_corrupt_shards_name_the_file(tmp_path):
    _capture_dir(tmp_path)
    path = tmp_path / shards.shard_file(2)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ValueError, match="shard-00002.safetensors: truncated"):
        shards.ShardDataset(tmp_path)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="shard-00002.safetensors: checksum mismatch"):
        shards.ShardDataset(tmp_path, verify_checksums=True)
    assert shards.finished_shard(tmp_path, 2, verify=True) is None


def test_plan_mismatch_is_refused(tmp_path):
    claim_dir(tmp_path, {"max_length": 128, "num_shards": 1})
    (tmp_path / shards.shard_record_file(0)).write_text("{}")  # a finished shard depends on it
    claim_dir(tmp_path, {"max_length": 128, "num_shards": 1})
    with pytest.raises(ValueError, match="max_length: existing=128 new=256"):
        claim_dir(tmp_path, {"max_length": 256, "num_shards": 1})


def test_bytes_per_token():
    # Qwen3-8B, 5 layers, bf16: 5 * 4096 * 2 + 4 + 4 + 1
    assert shards.bytes_per_token(5 * 4096, "bfloat16") == 40969


def test_rank_split_is_disjoint_and_complete():
    parts = [shards_for_rank(11, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(11))
    with pytest.raises(ValueError, match="rank=3"):
        shards_for_rank(11, 3, 3)


def test_load_conversations_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "data.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_conversations(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty|columns"):
        load_conversations(str(empty))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="columns"):
        load_conversations(str(wrong))


def test_load_conversations_shuffle_and_limit(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": str(i)}]}) + "\n" for i in range(20)))
    a = load_conversations(str(path), limit=5, shuffle_seed=1)
    b = load_conversations(str(path), limit=5, shuffle_seed=1)
    assert len(a) == 5 and a["messages"] == b["messages"]
    assert load_conversations(str(path), limit=5, shuffle_seed=None)[0]["messages"][0][
        "content"] == "0"
