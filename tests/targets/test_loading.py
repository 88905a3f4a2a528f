"""The one target loader and the drafter factory on the paths users take: hub ids through the
HF cache (offline), head-only by hub id, MASK ids from the tokenizer, per-layer-type RoPE."""

import json

import pytest

from dflash_lab.targets.loader import load_target, load_target_config, read_chat_template
from dflash_lab.targets.mask_token import resolve_mask_token_id
from dflash_lab.targets.shape import target_rope
from dflash_lab.train.factory import build_drafter, drafter_config_for_target
from tests.stand_ins import config_target, publish_to_hf_cache

REPO = "dflash-test/tiny-qwen3"


def test_hub_id_loads_from_the_offline_cache(tiny_target_dir, offline_hf_cache):
    publish_to_hf_cache(tiny_target_dir, REPO, offline_hf_cache)
    target = load_target(REPO, dtype="float32", device="cpu")
    assert target.name_or_path == REPO and target.num_hidden_layers == 8
    drafter = build_drafter(target, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3])
    assert drafter.config.hidden_size == target.hidden_size
    assert drafter.config.mask_token_id == target.tokenizer.convert_tokens_to_ids("<|mask|>")
    assert load_target_config(REPO).num_hidden_layers == 8
    head = load_target(REPO, dtype="float32", device="cpu", head_only=True)
    assert head.identity()["config_hash"] == target.identity()["config_hash"]


def test_missing_hub_id_says_it_is_not_in_the_cache(offline_hf_cache):
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        load_target("dflash-test/absent", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        load_target_config("dflash-test/absent")


def test_missing_local_path_is_named():
    with pytest.raises(ValueError, match="does not exist"):
        load_target("/nonexistent/model", dtype="float32", device="cpu")


def _tokenizer(tmp_path, mask_token=None, extra=("<end_of_turn>",)):
    """A saved and reloaded WordLevel tokenizer (as users load theirs) with added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "hello", "world", "the"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"mask_token": mask_token} if mask_token else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=list(extra), **kwargs)
    fast.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)


def test_mask_token_declared_in_tokenizer_config_is_used(tmp_path):
    tok = _tokenizer(tmp_path, mask_token="<mask>")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["mask_token"] == "<mask>"
    want = tok.convert_tokens_to_ids("<mask>")
    assert resolve_mask_token_id(tok, None, vocab_size=262_144, where="gemma") == want


def test_explicit_ordinary_token_is_refused_with_this_tokenizers_candidates(tmp_path):
    tok = _tokenizer(tmp_path, extra=("<end_of_turn>", "<unused0>"))
    with pytest.raises(ValueError, match="ordinary token 'hello'") as err:
        resolve_mask_token_id(tok, 2, vocab_size=262_144, where="gemma")
    message = str(err.value)
    assert "<unused0>" in message and f"[{len(tok)}, 262144)" in message
    assert "151669" not in message and "Qwen" not in message  # never another family's ids


def test_special_and_unreachable_ids_are_accepted(tmp_path):
    tok = _tokenizer(tmp_path, extra=("<end_of_turn>", "<unused0>"))
    unused = tok.convert_tokens_to_ids("<unused0>")
    assert resolve_mask_token_id(tok, unused, vocab_size=100, where="t") == unused
    assert resolve_mask_token_id(tok, 99, vocab_size=100, where="t") == 99  # no text -> 99
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        resolve_mask_token_id(tok, 100, vocab_size=100, where="t")


def test_no_declared_mask_token_lists_candidates(tmp_path):
    tok = _tokenizer(tmp_path, extra=("<end_of_turn>",))
    with pytest.raises(ValueError, match=r"declares no mask token.*\[\d+, 1000\)"):
        resolve_mask_token_id(tok, None, vocab_size=1000, where="t")


def test_rope_per_layer_type_takes_the_full_attention_entry():
    from transformers import Gemma3TextConfig, LlamaConfig

    gemma = Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             vocab_size=512)
    assert target_rope(gemma) == {"rope_theta": 1_000_000.0}
    sliding_theta = gemma.rope_parameters["sliding_attention"]["rope_theta"]
    assert sliding_theta != 1_000_000.0  # the test would not tell the entries apart otherwise
    llama = LlamaConfig(max_position_embeddings=16384, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert target_rope(llama) == {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    linear = LlamaConfig(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert target_rope(linear) == {"rope_theta": 1e4,
                                   "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def test_scaled_target_rope_is_taken_as_the_engines_apply_it(caplog):
    """yarn keeps every key it reads (the target's original length explicit, not the drafter's
    max_position_embeddings that transformers would fill in); dynamic gives plain RoPE (what
    vLLM precomputes); partial rotary is dropped; longrope is not implemented: plain RoPE,
    warned by name."""
    from transformers import Phi3Config, Qwen3Config

    yarn = Qwen3Config(max_position_embeddings=131072, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32, "attention_factor": 1.2})
    assert target_rope(yarn) == {"rope_theta": 1e6, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32, "attention_factor": 1.2}}
    dynamic = Qwen3Config(rope_theta=1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert target_rope(dynamic) == {"rope_theta": 1e4}
    partial = Qwen3Config(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                        "partial_rotary_factor": 0.5})
    assert target_rope(partial)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    phi = Phi3Config(hidden_size=64, num_attention_heads=2, rope_theta=1e4,
                     max_position_embeddings=4096, original_max_position_embeddings=1024,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16,
                                   "long_factor": [2.0] * 16})
    with caplog.at_level("WARNING", logger="dflash_lab.targets.shape"):
        assert target_rope(phi) == {"rope_theta": 1e4}
    assert "'longrope' is not implemented" in caplog.text


def test_drafter_for_a_gemma3_target_gets_its_shape_and_rope():
    from transformers import Gemma3TextConfig

    gemma = Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                             vocab_size=512)
    target = config_target({})
    target.model.config = gemma
    cfg = drafter_config_for_target(target, num_hidden_layers=1, block_size=4,
                                    target_layer_ids=[1, 3], mask_token_id=5)
    assert (cfg.head_dim, cfg.rope_theta, cfg.vocab_size) == (48, 1_000_000.0, 512)


def test_chat_template_spec(tmp_path):
    assert "<|im_start|>" in read_chat_template("chatml")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    js = tmp_path / "tokenizer_config.json"
    js.write_text(json.dumps({"chat_template": "X"}))
    assert read_chat_template(str(js)) == "X"
    with pytest.raises(ValueError, match="neither a file nor a built-in"):
        read_chat_template("no-such-template")


def test_chat_template_override_changes_the_identity(tiny_target_dir):
    plain = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    other = load_target(str(tiny_target_dir), dtype="float32", device="cpu",
                        chat_template="chatml")
    assert other.tokenizer.chat_template == read_chat_template("chatml")
    assert other.identity()["chat_template_hash"] != plain.identity()["chat_template_hash"]


def test_tiny_target_path_never_replaces_a_real_model_directory(tmp_path):
    from dflash_lab.targets.tiny import materialize_tiny_target

    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a tiny target built by dflash-lab"):
        materialize_tiny_target(model)
    assert (model / "config.json").read_text() == "{}"
