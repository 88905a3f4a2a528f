"""What the piece-by-piece checks of our exports against vLLM's own model code share
(scripts/vllm_dflash2_pieces.py, scripts/vllm_dspark_pieces.py, scripts/vllm_laguna_pieces.py):
the draft's VllmConfig on CPU, building the model class without an engine, the weight-load
audit, writing the vLLM side's pieces and report, and its command line (vLLM side, .venv-vllm: of
dflash_lab it imports only the standard-library ``dflash_lab/paths.py``); and loading our drafter
from a case's export (project venv: dflash_lab is imported inside :func:`our_drafter` only).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_lab.paths import atomic_path, atomic_write_text  # standard library only

#: the target's tensors (the engine shares them with the draft): not checked as written
SHARED = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")
TOLERANCE = 1e-5  #: float32, relative to the largest magnitude of each output


def vllm_config(case: Path, method: str, num_speculative_tokens: int) -> Any:
    """The VllmConfig of ``case/target`` with ``case/export`` as its ``method`` draft, fp32,
    eager, CPU (the caller lifts the V1-runner validation that refuses its draft first)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    model = ModelConfig(model=str(case / "target"), dtype="float32", skip_tokenizer_init=True,
                        enforce_eager=True, max_model_len=256)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(target_model_config=model, target_parallel_config=parallel,
                             model=str(case / "export"), method=method,
                             num_speculative_tokens=num_speculative_tokens)
    return VllmConfig(model_config=model, speculative_config=spec, parallel_config=parallel,
                      device_config=DeviceConfig("cpu"))


def build(config: Any, model_cls: type) -> torch.nn.Module:
    """``model_cls(vllm_config=config)`` in a one-process (TP = 1, gloo) distributed setup."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        return model_cls(vllm_config=config)


def _vllm_slice(params: dict[str, torch.Tensor], name: str, sizes: dict[str, int]) -> Any:
    """Where vLLM keeps our tensor ``name``: stacked q/k/v and gate/up rows at TP=1 (the
    backbone's; head tensors such as ``markov_head.*`` keep their names), or the tensor of the
    same name where the model keeps it unstacked (Laguna's separate gate_proj / up_proj)."""
    for ours, stacked, offset in (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", sizes["q"]),
                                  ("v_proj", "qkv_proj", sizes["q"] + sizes["kv"]),
                                  ("gate_proj", "gate_up_proj", 0),
                                  ("up_proj", "gate_up_proj", sizes["inter"])):
        if f".{ours}." in name and not name.startswith("markov_head."):
            full = params.get("model." + name.replace(ours, stacked))
            if full is not None:
                return full, offset
    full = params.get("model." + name)
    return None if full is None else (full, 0)


def load_check(model: torch.nn.Module, config: Any, ours: dict[str, torch.Tensor],
               cfg: dict) -> dict:
    """NaN-fill the float parameters, load ``ours`` with vLLM's own loader, then list the draft
    parameters left unwritten and the tensors of ours that did not land (``cfg``: the drafter's
    config.json keys head_dim, num_attention_heads, num_key_value_heads, intermediate_size)."""
    from vllm.config import set_current_vllm_config

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
        with set_current_vllm_config(config):
            model.load_weights(iter(ours.items()))
    params = dict(model.named_parameters())  # after loading: the loader may drop an unused head
    d = cfg["head_dim"]
    sizes = {"q": cfg["num_attention_heads"] * d, "kv": cfg["num_key_value_heads"] * d,
             "inter": cfg["intermediate_size"]}
    unplaced = []
    for name, tensor in ours.items():
        where = _vllm_slice(params, name, sizes)
        if where is None:
            unplaced.append(name)
            continue
        full, offset = where
        got = full[offset: offset + tensor.shape[0]] if full.dim() == 2 and full.shape != \
            tensor.shape else full
        if got.shape != tensor.shape or not torch.equal(got.to(tensor.dtype), tensor):
            unplaced.append(name)
    unwritten = [n for n, p in params.items() if n not in SHARED and p.is_floating_point()
                 and bool(p.isnan().any())]
    return {"unwritten_vllm_params": unwritten, "unplaced_tensors": unplaced,
            "num_tensors": len(ours), "num_vllm_params": len(params)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the largest magnitude of ``b``."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def write_pieces(case: Path, pieces: dict[str, torch.Tensor], report: dict) -> None:
    """The vLLM side's outputs: ``pieces`` to ``case/vllm_pieces.safetensors`` and ``report``
    (with the vLLM version added) to ``case/vllm_pieces.json``, each through a temporary path;
    the report is printed too."""
    import vllm
    from safetensors.torch import save_file

    report["vllm_version"] = vllm.__version__
    with atomic_path(case / "vllm_pieces.safetensors") as tmp:
        save_file(pieces, str(tmp))
    atomic_write_text(case / "vllm_pieces.json", json.dumps(report, indent=1))
    print(json.dumps(report))


def cli(run_vllm: Callable[[Path], None]) -> None:
    """The vLLM side's entry point: ``python -m scripts.vllm_<x>_pieces CASE_DIR`` runs
    ``run_vllm(CASE_DIR)``; any other argument count exits with the usage line."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} CASE_DIR  (run with .venv-vllm/bin/python)")
    run_vllm(Path(sys.argv[1]))


def our_drafter(case: Path) -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor]]:
    """(our drafter loaded from ``case/export`` in float32 eval mode, its config, the case's
    fixed inputs): the project side of a pieces check (project venv)."""
    from safetensors.torch import load_file

    from dflash_lab.export import load_source
    from dflash_lab.model.drafter import DFlashDrafter

    source = load_source(case / "export")
    drafter = DFlashDrafter(source.config).float().eval()
    drafter.load_state_dict(source.state_dict, strict=True)
    return drafter, source.config, load_file(str(case / "inputs.safetensors"))
