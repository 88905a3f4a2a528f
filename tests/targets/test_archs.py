"""Targets beyond Qwen3/Llama, on tiny random models in their published layouts (no download):
Gemma-4 (multimodal class, scaled embedding, logit soft-capping), Qwen3.5/3.6 (multimodal
checkpoint keys, linear-attention layers whose cache cannot be cropped) and MiMo-V2-Flash (MoE,
no sdpa). Each must load (full and head-only), capture, train, export and evaluate losslessly."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.eval.loop import DecodeSettings, baseline_generate, speculative_generate
from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.paths import CONF_DIR
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.targets.features import extract_features
from dflash_lab.targets.loader import load_target
from dflash_lab.targets.target import RawEmbedding, text_config
from dflash_lab.targets.tiny import MASK_TOKEN
from tests.eval_doubles import OracleProposer, RecordingProposer, tiny_drafter_for
from tests.tiny_archs import ARCHITECTURES, build_tiny_arch_target

ARCHS = sorted(ARCHITECTURES)
B = 5
LAYERS = [0, 2]


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tmp_path_factory, tiny_target_dir):
    out = tmp_path_factory.mktemp("archs") / request.param
    return build_tiny_arch_target(request.param, out, tiny_target_dir)


@pytest.fixture(scope="module")
def arch(arch_dir):
    return load_target(str(arch_dir), dtype="float32", device="cpu")


def test_shape_comes_from_the_language_model_config(arch, arch_dir):
    text = text_config(arch.model.config)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.vocab_size) == (4, 64, 768)
    assert text.num_hidden_layers == 4 and arch.identity()["hidden_size"] == 64
    pieces = arch.pieces()
    assert pieces.norm.weight.shape == (64,) and pieces.lm_head.weight.shape == (768, 64)


def test_the_drafter_reads_bare_embedding_rows(arch, arch_dir):
    """Engines feed the drafter the target's table rows; Gemma's HF module scales them."""
    embed = arch.pieces().embed_tokens
    ids = torch.arange(12)
    table = arch.model.get_input_embeddings().weight
    assert torch.equal(embed(ids), table[ids])
    hf_rows = arch.model.get_input_embeddings()(ids)
    if arch_dir.name == "gemma4":
        assert isinstance(embed, RawEmbedding) and embed.weight is table
        assert torch.allclose(hf_rows, table[ids] * 64 ** 0.5)
    else:
        assert embed is arch.model.get_input_embeddings()


def test_head_only_equals_the_full_load(arch, arch_dir):
    head = load_target(str(arch_dir), dtype="float32", device="cpu", head_only=True)
    full, part = arch.pieces(), head.pieces()
    for name in ("embed_tokens", "norm", "lm_head"):
        assert torch.equal(getattr(full, name).weight, getattr(part, name).weight), name
    assert head.identity() == arch.identity()
    ids = torch.arange(7)
    assert torch.equal(part.embed_tokens(ids), full.embed_tokens(ids))


def _one_forward(arch, ids):
    out = arch.model(input_ids=ids[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in LAYERS], dim=-1)[0]
    return out.logits[0].float(), feats


def test_runner_crops_and_continues_exactly(arch):
    """Prefill, then rounds of (feed a block, keep a prefix of it): every kept position's logits
    and features equal one forward over the whole kept sequence. On Qwen3.5's linear-attention
    layers a plain crop corrupts the state; the runner restores and replays instead."""
    gen = torch.Generator().manual_seed(0)
    runner = TargetRunner(arch.model, LAYERS)
    kept = torch.randint(3, 700, (9,), generator=gen)
    steps = [runner.forward(kept)]
    logits, feats = [steps[0].logits_nv], [steps[0].features_nf[0]]
    for keep in (1, 4, 2, 6, 3):
        block = torch.randint(3, 700, (6,), generator=gen)
        step = runner.forward(block)
        runner.crop(runner.length - 6 + keep)
        kept = torch.cat([kept, block[:keep]])
        logits.append(step.logits_nv[:keep])
        feats.append(step.features_nf[0, :keep])
        assert runner.length == kept.numel()
    for i in runner._recurrent:  # restored, not recorded: the conv state keeps its kernel size
        layer = runner.cache.layers[i]
        assert [c.shape[-1] for c in layer.conv_states.values()] == list(
            layer.conv_kernel_size.values())
    assert bool(runner._recurrent) == arch.model.config.model_type.startswith("qwen3_5")
    tail = runner.forward(torch.tensor([5, 6, 7]))  # the cache after the last crop is exact
    ref_logits, ref_feats = _one_forward(arch, torch.cat([kept, torch.tensor([5, 6, 7])]))
    torch.testing.assert_close(torch.cat(logits + [tail.logits_nv]), ref_logits,
                               atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(feats + [tail.features_nf[0]]), ref_feats,
                               atol=2e-4, rtol=1e-4)


def test_runner_logits_include_the_models_soft_capping(arch, arch_dir):
    ids = torch.randint(3, 700, (10,), generator=torch.Generator().manual_seed(1))
    logits = TargetRunner(arch.model).forward(ids).logits_nv
    torch.testing.assert_close(logits, arch.model(input_ids=ids[None]).logits[0].float())
    cap = getattr(text_config(arch.model.config), "final_logit_softcapping", None)
    if arch_dir.name == "gemma4":
        assert cap == 30.0 and logits.abs().max() < cap


@pytest.fixture(scope="module")
def prompts(arch):
    return [encode_prompt(arch.tokenizer, c[:1]) for c in demo_conversations(2, seed=31)]


def test_speculative_decoding_is_lossless_at_every_acceptance_length(arch, prompts):
    """An oracle that misses in a fixed varied pattern (every acceptance length occurs) and an
    untrained drafter: outputs equal plain decoding; the drafter's context features equal one
    forward over the final sequence."""
    settings = DecodeSettings(max_new_tokens=24)
    drafter = tiny_drafter_for(arch, block_size=B, target_layer_ids=LAYERS)
    pieces = arch.pieces()
    for prompt in prompts:
        base = baseline_generate(TargetRunner(arch.model), prompt, settings)
        seq = prompt + base.output_ids + [0] * B
        oracle = OracleProposer(seq, B, arch.vocab_size,
                                wrong=lambda c, t: (c * 7 + t * 3) % 11 == 0 or t == 1 + c % B)
        spec = speculative_generate(TargetRunner(arch.model, LAYERS), oracle, prompt, settings)
        assert spec.output_ids == base.output_ids
        assert len(set(spec.acceptance_lengths)) >= 3
        recorder = _FeatureLog(DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head))
        spec = speculative_generate(TargetRunner(arch.model, LAYERS), recorder, prompt, settings)
        assert spec.output_ids == base.output_ids
        seen = torch.cat(recorder.features, dim=1)[0]
        full = torch.tensor(prompt + base.output_ids)
        want = extract_features(arch.model, full[None], LAYERS).hidden_bsf[0]
        torch.testing.assert_close(seen, want[:seen.shape[0]], atol=2e-4, rtol=1e-4)


class _FeatureLog(RecordingProposer):
    """Records every context feature block the loop hands the drafter."""

    def __init__(self, inner):
        super().__init__(inner)
        self.features: list[torch.Tensor] = []

    def start(self, features_nf):
        self.features = [features_nf]
        super().start(features_nf)

    def extend(self, features_nf):
        self.features.append(features_nf)
        super().extend(features_nf)


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_capture_train_export_on_the_architecture(arch, arch_dir, tmp_path):
    """Capture demo conversations, train offline on the head-only target, export for both
    engines against the target's config (nested text_config included); Gemma 4 for vLLM only
    (SGLang 0.5.23 would feed its scaled embeddings), refused for both at start-up and export."""
    from dflash_lab.export.cli import main as export_main
    from dflash_lab.train.run import train

    rows = [{"messages": c} for c in demo_conversations(16, seed=4)]
    settings = CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=LAYERS,
                               max_length=80, hidden_dtype="float32", batch_size=8)
    manifest = run_capture(arch, rows, settings, {"path": "demo"}, progress=False)
    assert manifest["hidden_size"] == 64
    mask = arch.token_id(MASK_TOKEN)
    overrides = [
        "target=hf", f"target.name_or_path={arch_dir}", "target.dtype=float32",
        "target.device=cpu", "target.head_only=true", f"drafter.target_layer_ids={LAYERS}",
        f"drafter.mask_token_id={mask}", "drafter.num_hidden_layers=1", "drafter.block_size=4",
        "logger=none", f"paths.output_dir={tmp_path / 'run'}", "trainer=cpu",
        "trainer.max_epochs=1", "data.batch_size=4", "data.num_workers=0",
        "module.num_anchors=8", "data=offline", f"data.path={tmp_path / 'cap'}"]
    gemma = arch_dir.name == "gemma4"
    if gemma:  # SGLang feeds Gemma 4's scaled embedding module: refused before training
        with pytest.raises(ValueError, match="(?s)Gemma4ForConditionalGeneration.*export.engine"):
            train(_compose(overrides + ["export.enabled=true", "export.engine=both"]))
        assert not (tmp_path / "run" / "checkpoints").exists()
    result = train(_compose(overrides + ["export.enabled=false"]))
    assert result["val_tau_after"] >= 1.0 and result["best_checkpoint"]
    engine = ["--engine", "vllm"] if gemma else []
    rc = export_main([str(tmp_path / "run"), str(tmp_path / "export"), "--dtype", "float32",
                      "--target", str(arch_dir), *engine])
    assert rc == 0 and (tmp_path / "export" / "config.json").is_file()
    if gemma:
        assert export_main([str(tmp_path / "run"), str(tmp_path / "export2"), "--dtype",
                            "float32", "--target", str(arch_dir)]) != 0
        assert not (tmp_path / "export2").exists()
