"""The two evaluations behind ``dflash-eval``, as library functions: :func:`evaluate_prompts`
(speculative decoding and the baseline over tokenised prompts, any Proposer) and
:func:`run_generate` / :func:`run_features` (everything from an eval config, returning the report
dict; one :class:`~dflash_lab.eval.records.ResponseRecord` per response).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import Any

import torch
from hydra.utils import instantiate
from tqdm import tqdm

from dflash_lab.attention.base import resolve_backend_name
from dflash_lab.data.shards import ShardDataset, read_manifest
from dflash_lab.eval.loading import check_pair, load_drafter
from dflash_lab.eval.loop import (
    DecodeSettings,
    Generation,
    baseline_generate,
    machine_load,
    set_threads,
    speculative_generate,
)
from dflash_lab.eval.offline_tau import feature_eval
from dflash_lab.eval.proposer import DFlashProposer, Proposer, max_drafts
from dflash_lab.eval.records import ResponseRecord, context_buckets, record_from_generation
from dflash_lab.eval.report import generation_report
from dflash_lab.eval.sampling import check_sampling
from dflash_lab.eval.suite import (
    Turn,
    answer_every_prompt,
    budget,
    data_configs,
    dataset_name,
    items_before_target,
    items_with_target,
)
from dflash_lab.eval.target_runner import TargetRunner
from dflash_lab.targets.chat import target_stop_ids

log = logging.getLogger(__name__)
MODES = ("generate", "features")


#: How the speculative and baseline runs are timed (recorded in report.json ``timing``).
ORDER = "interleaved: per prompt, speculative then baseline on even prompts, the reverse on odd"


class Decoder:
    """Speculative decoding of one prompt and its plain-target baseline, one right after the other,
    so that both see the same machine load; which runs first alternates per prompt (:data:`ORDER`),
    so neither always gets the warmer caches. Response n samples with ``seed + n`` (T > 0)."""

    def __init__(self, model, proposer: Proposer, target_layer_ids: list[int], *,
                 baseline: bool = True, seed: int = 0, target_hidden_size: int | None = None):
        self.proposer, self.baseline, self.seed = proposer, baseline, seed
        self.spec_target = TargetRunner(model, target_layer_ids, target_hidden_size)
        self.base_target = TargetRunner(model, None)

    def _gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.spec_target.device).manual_seed(seed)

    def warm(self, ids: list[int], settings: DecodeSettings) -> None:
        """Run ``ids`` once for 8 tokens, untimed (lazy initialisation, kernel selection)."""
        self.respond(ids, replace(settings, max_new_tokens=8), 0)

    def respond(self, ids: list[int], settings: DecodeSettings, n: int,
                ) -> tuple[Generation, Generation | None]:
        def base() -> Generation | None:
            return (baseline_generate(self.base_target, ids, settings, self._gen(self.seed + n))
                    if self.baseline else None)

        first = base() if n % 2 else None
        spec = speculative_generate(self.spec_target, self.proposer, ids, settings,
                                    self._gen(self.seed + n))
        return spec, first if n % 2 else base()


def evaluate_prompts(model, proposer: Proposer, target_layer_ids: list[int],
                     prompts: list[list[int]], settings: DecodeSettings, *, baseline: bool = True,
                     seed: int = 0, warmup: bool = False, progress: bool = True,
                     on_prompt: Callable[[int, Generation], None] | None = None,
                     target_hidden_size: int | None = None,
                     ) -> tuple[list[Generation], list[Generation] | None]:
    """Speculative generations (and baseline generations) for every prompt. ``warmup`` first
    runs the first prompt untimed; ``target_hidden_size``: the drafter's per-layer width."""
    decoder = Decoder(model, proposer, target_layer_ids, baseline=baseline, seed=seed,
                      target_hidden_size=target_hidden_size)
    if warmup and prompts:
        decoder.warm(prompts[0], settings)
    spec, base = [], ([] if baseline else None)
    for i, ids in enumerate(tqdm(prompts, desc="dflash-eval", unit="prompt",
                                 disable=not progress)):
        gen, base_gen = decoder.respond(ids, settings, i)
        spec.append(gen)
        if base is not None:
            base.append(base_gen)
        if on_prompt is not None:
            on_prompt(i, gen)
    return spec, base


def _load_pair(cfg, packed: bool = False):
    """Target (the ``target`` group, completed by resolve_eval_target), drafter, backend."""
    target = instantiate(cfg.target)
    backend = resolve_backend_name(cfg.drafter.backend, target.device, packed=packed)
    log.info("drafter attention backend: %s on %s", backend, target.device)
    loaded = load_drafter(cfg.drafter.path, backend=backend, device=target.device,
                          dtype=target.model.dtype, block_size=cfg.block_size,
                          assume=cfg.drafter.assume,
                          verify_checksums=bool(cfg.drafter.get("verify_checksums", True)),
                          target_vocab_size=target.vocab_size)
    check_pair(loaded.drafter, target, loaded.depth_recorded)
    drafter = loaded.drafter
    drafter.walk_settings = drafter.config.head.walk_with(drafter.config,
                                                          dict(cfg.drafter.get("walk") or {}))
    return target, loaded, backend


@dataclass
class LocalResponder:
    """The local decoder as a :class:`~dflash_lab.eval.suite.Responder`: speculative decoding (and
    baseline) per prompt; a later turn follows the speculative answer without special tokens."""

    decoder: Decoder
    tokenizer: Any
    settings: Callable[[int], DecodeSettings]  #: a prompt's budget -> its decode settings
    greedy: bool
    on_prompt: Callable[[int, Generation], None] | None = None
    spec: list[Generation] = dc_field(default_factory=list)
    base: list[Generation] = dc_field(default_factory=list)

    def warm(self, ids: list[int], max_new: int) -> None:
        self.decoder.warm(ids, self.settings(max_new))

    def respond(self, ids: list[int], max_new: int, where: Turn) -> tuple[ResponseRecord, str]:
        spec, base = self.decoder.respond(ids, self.settings(max_new), len(self.spec))
        if self.on_prompt is not None:
            self.on_prompt(len(self.spec), spec)
        self.spec.append(spec)
        if base is not None:
            self.base.append(base)
        record = record_from_generation(where.dataset, where.index, where.turn, spec, base,
                                        self.greedy, prompt_tokens=len(ids))
        return record, self.tokenizer.decode(spec.output_ids, skip_special_tokens=True)


def run_generate(cfg, on_prompt: Callable[[int, Generation], None] | None = None,
                 ) -> dict[str, Any]:
    """Speculative decoding + baseline over the configured dataset(s) -> report dict."""
    check_sampling(cfg.temperature, cfg.sampling)
    configs = data_configs(cfg)
    budgets = [budget(cfg, d) for d in configs]
    items = items_before_target(configs, cfg.num_prompts)  # a bad file: before any loading
    timing = machine_load({"threads": set_threads(cfg.get("threads", "auto")),
                           "threads_option": cfg.get("threads", "auto"), "order": ORDER})
    target, loaded, backend = _load_pair(cfg)
    items = items_with_target(configs, items, cfg.num_prompts, target, budgets)
    pieces = target.pieces()
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    stops = tuple(target_stop_ids(target)) if cfg.stop_on_eos else ()
    decoder = Decoder(target.model, proposer, loaded.drafter.config.target_layer_ids,
                      baseline=cfg.baseline, seed=cfg.seed,
                      target_hidden_size=loaded.drafter.config.target_hidden_size)
    responder = LocalResponder(
        decoder, target.tokenizer,
        lambda max_new: DecodeSettings(max_new, float(cfg.temperature), cfg.sampling, stops),
        greedy=cfg.temperature == 0, on_prompt=on_prompt)
    records, asked = answer_every_prompt(responder, target.tokenizer, configs, items, budgets,
                                         warm=bool(cfg.warmup), progress=cfg.progress,
                                         label="dflash-eval")
    names = [dataset_name(d) for d in configs]
    sources = [str(d.path) if d.get("path") else str(d.get("hub_id")) for d in configs]
    record = {
        "target": target.name_or_path, "drafter": cfg.drafter.path,
        "drafter_source": loaded.description, "drafter_notes": loaded.notes,
        "variant": loaded.drafter.config.variant, "block_size": proposer.block_size,
        "trained_block_size": loaded.trained_block_size, "num_prompts": cfg.num_prompts,
        "temperature": cfg.temperature,
        "sampling": cfg.sampling if cfg.temperature > 0 else "greedy", "seed": cfg.seed,
        "stop_token_ids": list(stops), "backend": backend, "device": str(target.device),
        "dtype": cfg.target.dtype, "baseline": cfg.baseline,
        "context_buckets": context_buckets(cfg), "suite": cfg.get("suite"), "datasets": names,
        "data": sources[0] if len(configs) == 1 else sources,
        "max_new_tokens": budgets[0] if len(set(budgets)) == 1 else dict(zip(names, budgets)),
        "enable_thinking": configs[0].get("enable_thinking"),
        "reasoning_effort": configs[0].get("reasoning_effort"),
        "chat_template_kwargs": dict(configs[0].get("chat_template_kwargs") or {}),
        "chat_template": configs[0].chat_template,
    }
    timing = machine_load(timing)
    if "warning" in timing:
        log.warning("%s", timing["warning"])
    # the longest round: drafts + the bonus (B, or B + 1 with sample_from_anchor)
    report = generation_report(responder.spec, responder.base if cfg.baseline else None, asked,
                               max_drafts(proposer) + 1, record, records=records,
                               decode=lambda ids: target.tokenizer.decode(
                                   ids, skip_special_tokens=True))
    return {**report, "timing": timing}


def run_features(cfg) -> dict[str, Any]:
    """The feature-level tau simulator over a capture directory -> report dict."""
    if cfg.get("suite") is not None:
        raise ValueError(f"suite={cfg.suite} generates answers: use mode=generate (features "
                         "mode reads one capture, data.path=CAPTURE_DIR)")
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
                          anchors_per_forward=f.anchors_per_forward, progress=cfg.progress,
                          temperatures=f.get("temperatures"))
    report["settings"] = {
        "target": target.name_or_path, "drafter": cfg.drafter.path,
        "drafter_source": loaded.description, "drafter_notes": loaded.notes,
        "variant": drafter.config.variant, "data": cfg.data.path,
        "block_size": drafter.config.block_size, "trained_block_size": loaded.trained_block_size,
        "num_samples": cfg.num_prompts, "num_anchors": f.num_anchors, "seed": f.seed,
        "backend": backend, "device": str(target.device), "dtype": cfg.target.dtype,
    }
    return report
