"""Tiny target, loader, frozen pieces and feature extraction."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from dflash_lab.targets.features import extract_features, hf_hidden_state_indices
from dflash_lab.targets.loader import load_target
from dflash_lab.targets.target import TargetPieces, config_hash
from dflash_lab.targets.tiny import (
    MARKER_FILE,
    MASK_TOKEN,
    TinyTargetRecipe,
    build_tiny_target,
    materialize_tiny_target,
)

PROMPTS = [
    "What is 12 + 30?", "Spell the word tiger.", "Sort these numbers: 5, 88, 12.",
    "Count 5 numbers starting from 17.", "What is the opposite of up?",
]


def test_tiny_target_is_a_plain_hf_directory(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILE):
        assert (tiny_target_dir / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert model.config.model_type == "qwen3"
    assert len(tok) <= model.config.vocab_size <= 2048
    assert model.config.num_hidden_layers >= 5
    mask_id = json.loads((tiny_target_dir / MARKER_FILE).read_text())["mask_token_id"]
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == mask_id
    assert tok.decode([mask_id]) == MASK_TOKEN
    assert tok.chat_template


def test_tiny_target_head_dim_has_a_vllm_cpu_kernel(tiny_target_dir):
    """check-serving and the regeneration benchmark serve the demo's target as it is."""
    from benchmarks.vllm_server import VLLM_CPU_HEAD_SIZES

    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert config["head_dim"] in VLLM_CPU_HEAD_SIZES, config["head_dim"]
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]


def test_tiny_target_greedy_outputs_are_varied(tiny_target):
    tok, outs = tiny_target.tokenizer, []
    for prompt in PROMPTS:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], return_dict=True,
                                      add_generation_prompt=True, return_tensors="pt")
        gen = tiny_target.model.generate(**enc, max_new_tokens=16, do_sample=False)
        new = gen[0, enc["input_ids"].shape[1]:].tolist()
        assert len(set(new)) >= 5, tok.decode(new)  # not one repeated token
        outs.append(tuple(new))
    assert len(set(outs)) == len(PROMPTS)  # different prompts, different answers


def test_materialize_reuses_the_cached_directory(tiny_target_dir):
    before = (tiny_target_dir / "model.safetensors").stat().st_mtime_ns
    start = time.time()
    assert materialize_tiny_target(tiny_target_dir) == tiny_target_dir
    assert time.time() - start < 5
    assert (tiny_target_dir / "model.safetensors").stat().st_mtime_ns == before
    marker = json.loads((tiny_target_dir / MARKER_FILE).read_text())
    assert marker["digest"] == TinyTargetRecipe().digest()


def test_concurrent_builders_agree_and_another_recipe_replaces_the_directory(tmp_path):
    """Two builders of one small recipe at once leave one whole target (the later one keeps
    the equal result already there); another recipe replaces it; no temporary is left."""
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: F401
    # (imported first: two threads resolving transformers' lazy imports at once can fail)

    small = dict(corpus_size=64, train_steps=2, batch_size=2, seq_len=32)
    out = tmp_path / "t"
    errors = []

    def build():
        try:
            materialize_tiny_target(out, TinyTargetRecipe(seed=3, **small))
        except BaseException as err:  # noqa: BLE001 (a thread's error is asserted below)
            errors.append(err)

    builders = [threading.Thread(target=build) for _ in range(2)]
    for b in builders:
        b.start()
    for b in builders:
        b.join()
    assert errors == []
    digest = json.loads((out / MARKER_FILE).read_text())["digest"]
    assert digest == TinyTargetRecipe(seed=3, **small).digest()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    materialize_tiny_target(out, TinyTargetRecipe(seed=4, **small))
    digest = json.loads((out / MARKER_FILE).read_text())["digest"]
    assert digest == TinyTargetRecipe(seed=4, **small).digest()
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_tiny_target_is_deterministic_from_its_seed():
    small = dict(corpus_size=64, train_steps=2, batch_size=2, seq_len=32)
    _, m1, _ = build_tiny_target(TinyTargetRecipe(seed=3, **small))
    _, m2, _ = build_tiny_target(TinyTargetRecipe(seed=3, **small))
    _, m3, _ = build_tiny_target(TinyTargetRecipe(seed=4, **small))
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not all(torch.equal(s1[k], s3[k]) for k in s1)


def test_pieces_are_frozen_shared_modules(tiny_target):
    pieces = tiny_target.pieces()
    model = tiny_target.model
    assert pieces.embed_tokens is model.get_input_embeddings()
    assert pieces.lm_head is model.get_output_embeddings()
    assert pieces.norm is model.base_model.norm
    assert all(not p.requires_grad for p in pieces.parameters())
    holder = torch.nn.ModuleDict({"pieces": pieces})
    holder.train()
    assert not pieces.training
    assert isinstance(pieces, TargetPieces)


def test_features_match_hf_hidden_states_and_logits(tiny_target):
    ids = torch.randint(0, 600, (2, 23), generator=torch.Generator().manual_seed(0))
    layer_ids = [1, 3, 5]
    feats = extract_features(tiny_target.model, ids, layer_ids)
    out = tiny_target.model(ids, output_hidden_states=True)
    h = tiny_target.hidden_size
    assert feats.hidden_bsf.shape == (2, 23, 3 * h)
    for k, idx in enumerate(hf_hidden_state_indices(layer_ids)):
        assert torch.allclose(feats.hidden_bsf[..., k * h:(k + 1) * h], out.hidden_states[idx])
    assert torch.equal(feats.argmax_bs, out.logits.argmax(-1))


def test_right_padding_does_not_change_features(tiny_target):
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 600, (1, 17), generator=gen)
    b = torch.randint(0, 600, (1, 9), generator=gen)
    batch = torch.zeros(2, 17, dtype=torch.long)
    attn = torch.zeros_like(batch)
    batch[0], attn[0] = a[0], 1
    batch[1, :9], attn[1, :9] = b[0], 1
    both = extract_features(tiny_target.model, batch, [2, 4], attn)
    alone = extract_features(tiny_target.model, b, [2, 4])
    assert torch.allclose(both.hidden_bsf[1, :9], alone.hidden_bsf[0], atol=1e-5)
    assert torch.equal(both.argmax_bs[1, :9], alone.argmax_bs[0])


def test_bad_layer_ids_and_paths_are_refused(tiny_target, tmp_path):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="target_layer_ids"):
        extract_features(tiny_target.model, ids, [1, 8])
    with pytest.raises(ValueError, match="does not exist"):
        load_target(str(tmp_path / "nope"))


def test_identity_is_stable_and_dtype_free(tiny_target, tiny_target_dir):
    again = load_target(str(tiny_target_dir), dtype="bfloat16", device="cpu")
    a, b = tiny_target.identity(), again.identity()
    assert a["config_hash"] == b["config_hash"] == config_hash(tiny_target.model.config)
    assert a["tokenizer_hash"] == b["tokenizer_hash"]
    assert a["chat_template_hash"] == b["chat_template_hash"]
    assert (a["dtype"], b["dtype"]) == ("float32", "bfloat16")
