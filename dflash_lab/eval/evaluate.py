"""The two evaluations behind ``dflash-eval``, as library functions.

- :func:`evaluate_prompts`: speculative decoding (and the plain-target baseline) over tokenised
  prompts with any :class:`~dflash_lab.eval.proposer.Proposer`; returns per-prompt generations.
- :func:`run_generate` / :func:`run_features`: load everything from an eval config (conf/eval.yaml)
  and return the report dict (written by :func:`dflash_lab.eval.report.write_report`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from hydra.utils import instantiate
from tqdm import tqdm

from dflash_lab.attention.base import resolve_backend_name
from dflash_lab.eval.features import feature_eval
from dflash_lab.eval.loading import check_pair, load_drafter
from dflash_lab.eval.loop import (
    DecodeSettings,
    Generation,
    baseline_generate,
    speculative_generate,
)
from dflash_lab.eval.prompts import load_prompts
from dflash_lab.eval.proposer import DFlashProposer, Proposer
from dflash_lab.eval.report import generation_report
from dflash_lab.eval.sampling import check_sampling
from dflash_lab.eval.target_runner import TargetRunner

log = logging.getLogger(__name__)
MODES = ("generate", "features")


def stop_token_ids(tokenizer, model) -> tuple[int, ...]:
    """EOS ids of the tokenizer and the generation config (end-of-turn for chat models)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return tuple(sorted(int(i) for i in ids if i is not None))


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def evaluate_prompts(model, proposer: Proposer, target_layer_ids: list[int],
                     prompts: list[list[int]], settings: DecodeSettings, *, baseline: bool = True,
                     seed: int = 0, warmup: bool = False, progress: bool = True,
                     on_prompt: Callable[[int, Generation], None] | None = None,
                     ) -> tuple[list[Generation], list[Generation] | None]:
    """Speculative generations (and baseline generations) for every prompt, interleaved so that
    both see the same machine load. ``warmup`` first runs the first prompt untimed (lazy
    initialisation, kernel selection)."""
    spec_target = TargetRunner(model, target_layer_ids)
    base_target = TargetRunner(model, None)
    device = spec_target.device
    if warmup and prompts:
        short = DecodeSettings(**{**vars(settings), "max_new_tokens": 8})
        speculative_generate(spec_target, proposer, prompts[0], short, _generator(device, seed))
        if baseline:
            baseline_generate(base_target, prompts[0], short, _generator(device, seed))
    spec, base = [], ([] if baseline else None)
    for i, ids in enumerate(tqdm(prompts, desc="dflash-eval", unit="prompt",
                                 disable=not progress)):
        gen = speculative_generate(spec_target, proposer, ids, settings,
                                   _generator(device, seed + i))
        spec.append(gen)
        if base is not None:
            base.append(baseline_generate(base_target, ids, settings,
                                          _generator(device, seed + i)))
        if on_prompt is not None:
            on_prompt(i, gen)
    return spec, base


def _settings_record(cfg, target, block_size: int, trained: int, description: str,
                     notes: list[str], stop_ids: tuple[int, ...], backend: str,
                     variant: str) -> dict[str, Any]:
    return {
        "target": target.name_or_path, "drafter": cfg.drafter.path, "drafter_source": description,
        "drafter_notes": notes, "variant": variant, "data": cfg.data.path, "block_size": block_size,
        "trained_block_size": trained, "max_new_tokens": cfg.max_new_tokens,
        "num_prompts": cfg.num_prompts, "temperature": cfg.temperature,
        "sampling": cfg.sampling if cfg.temperature > 0 else "greedy", "seed": cfg.seed,
        "enable_thinking": cfg.data.enable_thinking, "chat_template": cfg.data.chat_template,
        "stop_token_ids": list(stop_ids), "backend": backend, "device": str(target.device),
        "dtype": cfg.target.dtype, "baseline": cfg.baseline,
    }


def _load_pair(cfg, packed: bool = False):
    """Target (the ``target`` group, completed by resolve_eval_target), drafter, backend."""
    target = instantiate(cfg.target)
    backend = resolve_backend_name(cfg.drafter.backend, target.device, packed=packed)
    log.info("drafter attention backend: %s on %s", backend, target.device)
    loaded = load_drafter(cfg.drafter.path, backend=backend, device=target.device,
                          dtype=target.model.dtype, block_size=cfg.block_size,
                          assume=cfg.drafter.assume)
    check_pair(loaded.drafter, target)
    return target, loaded, backend


def run_generate(cfg, on_prompt: Callable[[int, Generation], None] | None = None,
                 ) -> dict[str, Any]:
    """Speculative decoding + baseline over the configured prompts -> report dict."""
    check_sampling(cfg.temperature, cfg.sampling)
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    target, loaded, backend = _load_pair(cfg)
    pieces = target.pieces()
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    d = cfg.data
    prompts = load_prompts(target.tokenizer, d.path, num_prompts=cfg.num_prompts, split=d.split,
                           shuffle_seed=d.shuffle_seed, chat_template=d.chat_template,
                           enable_thinking=d.enable_thinking, prompt_format=d.prompt_format,
                           max_prompt_tokens=d.max_prompt_tokens)
    stops = stop_token_ids(target.tokenizer, target.model) if cfg.stop_on_eos else ()
    settings = DecodeSettings(cfg.max_new_tokens, float(cfg.temperature), cfg.sampling, stops)
    ids = [p.ids for p in prompts]
    spec, base = evaluate_prompts(target.model, proposer, loaded.drafter.config.target_layer_ids,
                                  ids, settings, baseline=cfg.baseline, seed=cfg.seed,
                                  warmup=cfg.warmup, progress=cfg.progress, on_prompt=on_prompt)
    record = _settings_record(cfg, target, proposer.block_size, loaded.trained_block_size,
                              loaded.description, loaded.notes, stops, backend,
                              loaded.drafter.config.variant)
    return generation_report(spec, base, ids, proposer.block_size, record)


def run_features(cfg) -> dict[str, Any]:
    """The feature-level tau simulator over a capture directory -> report dict."""
    from dflash_lab.data.shards import ShardDataset, read_manifest

    read_manifest(cfg.data.path)  # a ValueError naming the directory before any loading
    target, loaded, backend = _load_pair(cfg, packed=True)
    drafter = loaded.drafter
    dataset = ShardDataset(cfg.data.path, target_layer_ids=drafter.config.target_layer_ids,
                           hidden_size=drafter.config.hidden_size,
                           vocab_size=drafter.config.vocab_size, target=target.identity(),
                           allow_other_weights=bool(cfg.data.get("allow_other_target_weights")))
    if cfg.num_prompts is not None and cfg.num_prompts > len(dataset):
        log.warning("num_prompts=%d but the capture %s holds %d samples: evaluating all %d",
                    cfg.num_prompts, cfg.data.path, len(dataset), len(dataset))
    f = cfg.features
    report = feature_eval(drafter, target.pieces(), dataset, num_samples=cfg.num_prompts,
                          num_anchors=f.num_anchors, seed=f.seed,
                          anchors_per_forward=f.anchors_per_forward, progress=cfg.progress)
    report["settings"] = {
        "target": target.name_or_path, "drafter": cfg.drafter.path,
        "drafter_source": loaded.description, "drafter_notes": loaded.notes,
        "variant": drafter.config.variant, "data": cfg.data.path,
        "block_size": drafter.config.block_size, "trained_block_size": loaded.trained_block_size,
        "num_samples": cfg.num_prompts, "num_anchors": f.num_anchors, "seed": f.seed,
        "backend": backend, "device": str(target.device), "dtype": cfg.target.dtype,
    }
    return report
