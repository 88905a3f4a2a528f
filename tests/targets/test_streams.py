"""Multi-stream targets (hyper-connections, ``hc_mult`` residual streams) on a tiny random model of
transformers' own DeepseekV4ForCausalLM: what a drafter reads of each layer (the mean of the
streams, as vLLM 0.32 and SGLang 0.5.23 feed it, or the flattened streams), in capture, in the
online feature source, in the eval runner, and the checks that refuse a width or a layer id the
target cannot give."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.shards import ShardDataset
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.targets.features import (
    OnlineFeatures,
    extract_features,
    layer_features,
    num_streams,
    stream_widths,
)
from dflash_lab.targets.loader import load_target
from tests.tiny_archs import DEEPSEEK_V4_STREAMS, build_tiny_arch_target

H, N = 64, DEEPSEEK_V4_STREAMS
LAYERS = [1, 3]  # z-lab ids: outputs of decoder layers 1 and 3 of 6
DEPTH = 6


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory, tiny_target_dir):
    return build_tiny_arch_target("deepseek_v4", tmp_path_factory.mktemp("dsv4") / "t",
                                  tiny_target_dir, num_hidden_layers=DEPTH)


@pytest.fixture(scope="module")
def ds(ds_dir):
    return load_target(str(ds_dir), dtype="float32", device="cpu")


def _layer_outputs(model, ids_bs):
    """Each decoder layer's output streams [Bt, S, n, H], read by forward hooks on the layers
    themselves (not through output_hidden_states): the tensor vLLM averages per aux layer."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(i, out)))
    try:
        model(input_ids=ids_bs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_the_target_has_streams_and_two_widths(ds):
    assert num_streams(ds.model.config) == N and ds.hidden_size == H
    assert stream_widths(ds.model.config) == (H, N * H)
    out = ds.model(input_ids=torch.arange(5)[None], output_hidden_states=True)
    assert out.hidden_states[1].shape == (1, 5, N, H)  # streams kept by transformers


def test_layer_features_mean_or_flatten_the_streams():
    state = torch.randn(2, 3, N, H)
    assert torch.equal(layer_features(state, H), state.mean(dim=-2))
    assert torch.equal(layer_features(state, N * H), state.reshape(2, 3, N * H))
    plain = torch.randn(2, 3, H)
    assert layer_features(plain, H) is plain
    with pytest.raises(ValueError, match=r"4 streams of 64.*use 64 \(stream mean\) or 256"):
        layer_features(state, 100)
    with pytest.raises(ValueError, match="64 wide, the drafter reads 256"):
        layer_features(plain, N * H)


@pytest.mark.parametrize("width", [None, H, N * H])
def test_extract_features_are_the_engines_per_layer_features(ds, width):
    """Default / H: each layer's output streams averaged (vLLM models/deepseek_v4
    aux_recon.mean(dim=1), SGLang mhc_stream_mean); n*H: the streams flattened."""
    ids = torch.randint(3, 700, (2, 11), generator=torch.Generator().manual_seed(0))
    feats = extract_features(ds.model, ids, LAYERS, target_hidden_size=width)
    outs = _layer_outputs(ds.model, ids)
    reduce = (lambda s: s.flatten(-2)) if width == N * H else (lambda s: s.mean(dim=-2))
    want = torch.cat([reduce(outs[i]) for i in LAYERS], dim=-1)
    assert feats.hidden_bsf.shape == (2, 11, len(LAYERS) * (width or H))
    torch.testing.assert_close(feats.hidden_bsf, want)
    online = OnlineFeatures(ds.model, LAYERS, width)(ids)
    torch.testing.assert_close(online.hidden_bsf, want)


def test_widths_and_ids_the_target_cannot_give_are_refused(ds):
    ids = torch.arange(6)[None]
    with pytest.raises(ValueError, match=r"target_hidden_size=100.*\[64, 256\].*64 \(the mean"):
        extract_features(ds.model, ids, LAYERS, target_hidden_size=100)
    with pytest.raises(ValueError, match=r"id 5 \(the last layer\) of a multi-stream target"):
        extract_features(ds.model, ids, [1, DEPTH - 1])
    with pytest.raises(ValueError, match="target_hidden_size=257"):
        TargetRunner(ds.model, LAYERS, N * H + 1)


@pytest.mark.parametrize("width", [None, N * H])
def test_the_eval_runner_feeds_the_same_features_across_crops(ds, width):
    gen = torch.Generator().manual_seed(3)
    runner = TargetRunner(ds.model, LAYERS, width)
    kept = torch.randint(3, 700, (9,), generator=gen)
    feats = [runner.forward(kept).features_nf[0]]
    for keep in (1, 4, 2):
        block = torch.randint(3, 700, (6,), generator=gen)
        step = runner.forward(block)
        runner.crop(runner.length - 6 + keep)
        kept = torch.cat([kept, block[:keep]])
        feats.append(step.features_nf[0, :keep])
    want = extract_features(ds.model, kept[None], LAYERS, target_hidden_size=width).hidden_bsf
    torch.testing.assert_close(torch.cat(feats), want[0], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("width", [None, N * H])
def test_capture_records_the_width_and_training_data_checks_it(ds, width, tmp_path):
    rows = [{"messages": c} for c in demo_conversations(4, seed=4)]
    settings = CaptureSettings(out_dir=str(tmp_path / "cap"), target_layer_ids=LAYERS,
                               max_length=48, hidden_dtype="float32", batch_size=4,
                               target_hidden_size=width)
    manifest = run_capture(ds, rows, settings, {"path": "demo"}, progress=False)
    per_layer = width or H
    assert manifest["hidden_size"] == H and manifest["feature_dim"] == 2 * per_layer
    # recorded only when it is not the hidden size (older captures resume with their plan)
    assert manifest.get("target_hidden_size") == (width if width != H else None)
    data = ShardDataset(tmp_path / "cap", target_layer_ids=LAYERS, hidden_size=H,
                        target_hidden_size=per_layer)
    item = data[0]
    assert item["hidden"].shape[-1] == 2 * per_layer
    want = extract_features(ds.model, item["input_ids"][None], LAYERS,
                            target_hidden_size=width).hidden_bsf[0]
    torch.testing.assert_close(item["hidden"], want, atol=2e-4, rtol=1e-4)  # batched vs alone
    other = N * H if width is None else H
    with pytest.raises(ValueError, match=f"target_hidden_size={per_layer}.*{other} was expected"):
        ShardDataset(tmp_path / "cap", target_layer_ids=LAYERS, target_hidden_size=other)


def test_a_single_stream_target_names_its_one_width_and_the_fix():
    from transformers import Qwen3Config

    from dflash_lab.targets.features import check_feature_width

    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, vocab_size=100)
    assert check_feature_width(config, None, "drafter.target_hidden_size") == 64
    with pytest.raises(ValueError, match=r"drafter.target_hidden_size=100: the target gives "
                                         r"features \[64\] wide per layer; use 64, the target's "
                                         r"hidden_size \(leave it unset: null is that width\)"):
        check_feature_width(config, 100, "drafter.target_hidden_size")
