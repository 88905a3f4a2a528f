"""The speculators side of benchmark 3, run by ``benchmarks/peer_speculators.py`` with the
interpreter of the speculators venv (``.venv-speculators``): it must not import dflash_lab.

Builds speculators' own DFlash draft model (``DFlashDraftModel``, or ``DFlash2DraftModel`` when
the shape's config says ``"variant": "dflash2"``: its conv and candidate selector, unary CE plus
``selector_loss_alpha`` x its K-way selector CE, eager TV metric) with the shape given on the
command line, sdpa attention and its eager CE loss on CPU, and times full optimizer steps
(their forward with anchor sampling, mask building and target projection, their loss, backward,
AdamW) on request over a line protocol (:func:`serve`), so the orchestrator can alternate single
steps of both sides; also their no-grad target projection (verifier norm + LM head at the
anchored slots) alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import time
from pathlib import Path

import torch


def _kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", required=True, help="JSON: drafter and run dimensions")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--allocator", default="default", choices=["pinned", "default"])
    a = p.parse_args()
    if a.allocator == "pinned":  # as benchmarks/common.py: peak RSS must follow live tensors
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)
        libc.mallopt(-1, 128 * 1024)
    shape = json.loads(a.shape)
    device = torch.device(a.device)
    from speculators.losses import resolve_loss_config
    from transformers import Qwen3Config

    c = shape["config"]
    layer_cfg = Qwen3Config(
        hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=c.get("rope_theta", 1e6),
        max_position_embeddings=4 * shape["seq_len"])
    layer_cfg._attn_implementation = shape.get("attn", "sdpa")
    model_cls, cfg_cls, extra = _model_classes(c)
    cfg = cfg_cls(
        transformer_layer_config=layer_cfg, draft_vocab_size=c["vocab_size"],
        block_size=c["block_size"], aux_hidden_state_layer_ids=c["target_layer_ids"],
        mask_token_id=c["mask_token_id"], **extra)
    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():  # frozen target pieces are loaded from the verifier normally
        for name in ("embed_tokens", "lm_head", "verifier_lm_head"):
            getattr(model, name).weight.normal_(0.0, 0.02)
    model.to(device).train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    implementation = shape.get("loss_implementation", "eager")
    loss_cfg = resolve_loss_config("ce", implementation)
    step_kwargs = {}
    if c.get("variant") == "dflash2":  # their default TV metric is the Triton kernel
        step_kwargs = {"tv_loss_fn": resolve_loss_config("tv", implementation)["tv"][0],
                       "selector_loss_alpha": shape.get("selector_alpha", 1.0)}

    s, n, h = shape["seq_len"], shape["num_anchors"], c["hidden_size"]
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, s, len(c["target_layer_ids"]) * h, generator=g).to(device)
    ids = torch.randint(0, c["vocab_size"] - 1, (1, s), generator=g).to(device)
    loss_mask = torch.ones(1, s, dtype=torch.long, device=device)
    last_hidden = torch.randn(1, s, h, generator=g).to(device)
    doc_ids = torch.zeros(1, s, dtype=torch.long, device=device)

    def step() -> float:
        _, loss, _ = model(feats, ids, loss_mask, last_hidden, doc_ids, loss_config=loss_cfg,
                           gamma=shape["gamma"], max_anchors=n, **step_kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    rows = torch.arange(n * c["block_size"], device=device) % s

    def projection() -> None:
        with torch.no_grad():
            model.verifier_lm_head(model.verifier_norm(last_hidden[:, rows]))

    for _ in range(a.warmup):
        step()
    serve({"step": step, "projection": projection}, device, {
        "who": "speculators", "trainable_params": sum(q.numel() for q in params),
        "torch": torch.__version__})


def _model_classes(c: dict) -> tuple[type, type, dict]:
    """(model class, config class, DFlash 2 config fields) for the shape's variant."""
    if c.get("variant", "dflash1") == "dflash1":
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

        return DFlashDraftModel, DFlashSpeculatorConfig, {}
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return DFlash2DraftModel, DFlash2SpeculatorConfig, {k: c[k] for k in keys}


def serve(actions: dict, device: torch.device, info: dict) -> None:
    """Line protocol on stdin/stdout (the same as our worker's): ``time NAME`` runs an action
    and answers its seconds; ``peak NAME`` answers the resident-set peak above the level before
    it, plus what the optional ``held`` action reports is kept alive between steps (our DFlash 2
    codebook gradients: memory a fresh buffer would add inside the step); ``info``; ``quit``.
    The orchestrator alternates the two workers step by step."""
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        cmd, _, name = line.strip().partition(" ")
        if cmd == "quit":
            break
        if cmd == "time":
            _sync(device)
            t0 = time.perf_counter()
            out = actions[name]()
            _sync(device)
            print(json.dumps({"seconds": time.perf_counter() - t0, "value": out}), flush=True)
        elif cmd == "peak":
            held = actions["held"]() if "held" in actions else 0
            rss0 = _kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            actions[name]()
            print(json.dumps({"peak_bytes": (_kib("VmHWM") - rss0) * 1024 + held}), flush=True)


if __name__ == "__main__":
    main()
