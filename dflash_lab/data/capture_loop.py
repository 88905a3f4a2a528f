"""The capture loop: conversations -> target features -> shards, split over ranks, resumable. Shard
s (``shard_size`` consecutive input rows) is rank ``s % world_size``'s; names do not depend on the
world size (a capture resumes with any number of processes); the last rank merges ``manifest.json``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_lab.data import shards
from dflash_lab.data.capture_server import server_capture_batch
from dflash_lab.data.conversations import TokenizedRows, check_bad_rows_mode, tokenize_rows
from dflash_lab.targets.chat import TurnEnd, find_turn_end, target_stop_ids
from dflash_lab.targets.features import (
    check_feature_width,
    check_layer_ids_for_streams,
    check_target_layer_ids,
    extract_features,
    hf_hidden_state_indices,
)
from dflash_lab.terminal import Bar

log = logging.getLogger(__name__)

#: A shard with at least this many rows, all bad, stops the capture even with bad_rows=skip.
_ALL_BAD_MIN_ROWS = 4


@dataclass
class CaptureSettings:
    """What to capture and how (all recorded in the capture plan except the runtime knobs)."""

    out_dir: str
    target_layer_ids: list[int]
    max_length: int = 2048  #: tokens per sample; longer conversations are truncated
    hidden_dtype: str = "bfloat16"  #: storage dtype of ``hidden``
    shard_size: int = 256  #: input rows per shard
    last_turn_only: bool = False  #: loss only on the last assistant turn
    enable_thinking: bool | None = None  #: passed to the chat template when not None
    batch_size: int = 8  #: runtime: sequences per forward pass
    verify_existing: bool = True  #: runtime: re-hash finished shards before skipping them
    #: runtime: a bad row (roles not alternating, empty turn, no assistant turn, template
    #: error) is logged with its input row and skipped ("skip", counted in the manifest), or
    #: stops the run ("error"). Runtime so that a run stopped by a bad row resumes with "skip".
    bad_rows: str = "skip"
    #: what of the target's next-token distribution to keep beside the argmax (recorded):
    #: ``last_hidden`` (its final-normed last hidden state: the exact distribution through the
    #: LM head at training time) and/or ``topk`` (the ``distribution_topk`` likeliest tokens and
    #: their log-probabilities; the rest is one tail bucket). Empty: argmax labels only.
    distribution: tuple[str, ...] = ()
    distribution_topk: int = 64
    #: width of one layer's features (recorded): null = the target's hidden size (a
    #: multi-stream target: the mean of its streams, what vLLM and SGLang feed a drafter);
    #: hc_mult * hidden_size = its flattened streams (targets/features.py)
    target_hidden_size: int | None = None


def check_distribution(kinds, topk: int) -> tuple[str, ...]:
    """``capture.distribution`` as a tuple of known kinds (ValueError naming the bad value)."""
    if isinstance(kinds, str):
        kinds = [kinds]
    kinds = tuple(str(k) for k in (kinds or ()))
    bad = [k for k in kinds if k not in shards.DISTRIBUTION_KINDS]
    if bad:
        raise ValueError(f"capture.distribution={list(kinds)}: unknown {bad}; use a list of "
                         f"{list(shards.DISTRIBUTION_KINDS)} (e.g. "
                         "capture.distribution=[last_hidden]) or [] for argmax labels only")
    if "topk" in kinds and not (isinstance(topk, int) and topk >= 1):
        raise ValueError(f"capture.distribution_topk={topk!r}: give a count >= 1")
    return kinds


def shards_for_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """Deterministic, disjoint split: shard s goes to rank s % world_size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return list(range(rank, num_shards, world_size))


def build_plan(target, settings: CaptureSettings, num_rows: int,
               source: dict[str, Any], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings every rank and every resume must share (becomes part of the manifest).
    ``engine`` ({"engine": "vllm", "engine_version": ..., ...}) joins the target identity when
    a serving engine computed the hidden states; an in-process capture records none."""
    if settings.hidden_dtype not in shards.HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype={settings.hidden_dtype!r}: use one of "
                         f"{sorted(shards.HIDDEN_DTYPES)}")
    check_target_layer_ids(settings.target_layer_ids, target.num_hidden_layers)
    check_layer_ids_for_streams(target.model.config, settings.target_layer_ids)
    width = check_feature_width(target.model.config, settings.target_hidden_size,
                                "capture.target_hidden_size")
    check_bad_rows_mode(settings.bad_rows, "capture.bad_rows")
    ids = [int(i) for i in settings.target_layer_ids]
    identity = target.identity() | (engine or {})
    feature_dim = len(ids) * width
    kinds = check_distribution(settings.distribution, settings.distribution_topk)
    held = {"last_hidden": "last_hidden" in kinds,
            "topk": settings.distribution_topk if "topk" in kinds else 0}
    # recorded only when asked for: a capture from before the option resumes with its plan
    extra = {"distribution": held} if kinds else {}
    if width != target.hidden_size:
        extra["target_hidden_size"] = width
    per_token = shards.bytes_per_token(
        feature_dim, settings.hidden_dtype, topk=held["topk"],
        last_hidden_size=target.hidden_size if held["last_hidden"] else 0)
    return {
        "target": identity,
        "target_layer_ids": ids,  # z-lab / SGLang convention: output of decoder layer i
        "hf_hidden_state_indices": hf_hidden_state_indices(ids),  # = vLLM / speculators aux ids
        "hidden_size": target.hidden_size,
        "feature_dim": feature_dim,
        "hidden_dtype": settings.hidden_dtype,
        "bytes_per_token": per_token,
        "chat_template_hash": identity["chat_template_hash"],
        "max_length": settings.max_length,
        "last_turn_only": settings.last_turn_only,
        "enable_thinking": settings.enable_thinking,
        "shard_size": settings.shard_size,
        "num_input_rows": num_rows,
        "num_shards": math.ceil(num_rows / settings.shard_size),
        "source": source,
        **extra,
    }


def _tokenize_rows(target, rows, first_row: int, settings: CaptureSettings, where: str,
                   turn_end: TurnEnd) -> TokenizedRows:
    """Samples of ``rows`` (positions from ``first_row``) plus their bad / zero-loss rows. Every
    row of a shard of several bad raises: a template or data-format problem, not rows to skip."""
    out = tokenize_rows(target.tokenizer, rows, first_row, source=where,
                        bad_rows=settings.bad_rows, setting="capture.bad_rows",
                        max_length=settings.max_length, last_turn_only=settings.last_turn_only,
                        enable_thinking=settings.enable_thinking, turn_end=turn_end)
    if len(rows) >= _ALL_BAD_MIN_ROWS and len(out.bad_rows) == len(rows):
        first = out.bad_rows[0]
        raise ValueError(f"{where}: all {len(rows)} rows of a shard are bad (first: row "
                         f"{first['row']}: {first['reason']}); check the chat template and the "
                         "data format (capture.bad_rows=skip only skips a few bad rows)")
    return out


def _capture_batch(target, batch, settings: CaptureSettings) -> list[shards.CapturedSample]:
    """One right-padded forward pass over ``batch`` [(row id, TokenizedConversation)]."""
    lengths = [len(tc.input_ids) for _, tc in batch]
    pad_id = target.tokenizer.pad_token_id or 0
    ids_bs = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
    attn_bs = torch.zeros_like(ids_bs)
    for b, (_, tc) in enumerate(batch):
        ids_bs[b, :lengths[b]] = tc.input_ids
        attn_bs[b, :lengths[b]] = 1
    topk = settings.distribution_topk if "topk" in settings.distribution else 0
    feats = extract_features(target.model, ids_bs, settings.target_layer_ids, attn_bs,
                             out_device="cpu", topk=topk,
                             target_hidden_size=settings.target_hidden_size)
    dtype = shards.HIDDEN_DTYPES[settings.hidden_dtype]
    keep_last = "last_hidden" in settings.distribution

    def rows(t, b):
        return None if t is None else t[b, :lengths[b]]

    return [
        shards.CapturedSample(row_id, tc.input_ids, tc.loss_mask,
                              feats.hidden_bsf[b, :lengths[b]].to(dtype),
                              feats.argmax_bs[b, :lengths[b]],
                              rows(feats.last_bsh, b).to(dtype) if keep_last else None,
                              rows(feats.top_ids_bsk, b), rows(feats.top_logprobs_bsk, b))
        for b, (row_id, tc) in enumerate(batch)
    ]


def capture_shard(target, rows, index: int, settings: CaptureSettings, where: str = "data",
                  turn_end: TurnEnd | None = None, server=None
                  ) -> tuple[list[shards.CapturedSample], dict[str, Any]]:
    """Features of the rows of shard ``index`` (batched longest-first, returned in row order) and
    the shard record's report: ``bad_rows`` ({"row", "reason"}), ``zero_loss_rows``, per-sample
    ``min_loss_tokens`` / ``max_loss_tokens``. With ``server`` (a ``HiddenStatesServer``) the
    hidden states come from the engine, the target supplying only its final norm and LM head."""
    if turn_end is None:
        turn_end = find_turn_end(target.tokenizer, target_stop_ids(target),
                                 settings.enable_thinking)
    tokenized = _tokenize_rows(target, rows, index * settings.shard_size, settings, where,
                               turn_end)
    todo = sorted(tokenized.samples, key=lambda item: -len(item[1].input_ids))  # less padding
    samples = []
    for start in range(0, len(todo), settings.batch_size):
        batch = todo[start:start + settings.batch_size]
        samples.extend(_capture_batch(target, batch, settings) if server is None else
                       server_capture_batch(server, target.pieces(), batch, settings))
    loss = [int(tc.loss_mask.sum()) for _, tc in tokenized.samples]
    report = {"bad_rows": tokenized.bad_rows, "zero_loss_rows": tokenized.zero_loss_rows,
              "min_loss_tokens": min(loss, default=0), "max_loss_tokens": max(loss, default=0)}
    return sorted(samples, key=lambda s: s.sample_id), report


def run_capture(target, dataset, settings: CaptureSettings, source: dict[str, Any], *,
                rank: int = 0, world_size: int = 1, progress: bool = True, server=None,
                engine: dict[str, Any] | None = None) -> dict | None:
    """Capture this rank's unfinished shards of ``dataset`` (rows with messages/conversations),
    then merge the manifest if every shard is done (returned, else None); an interrupted run
    loses at most the shard in flight. ``server``: the hidden states from that engine
    (:func:`capture_shard`), whose name and version ``engine`` joins the plan's target identity."""
    out_dir = Path(settings.out_dir)
    plan = build_plan(target, settings, len(dataset), source, engine)
    turn_end = find_turn_end(target.tokenizer, target_stop_ids(target), settings.enable_thinking)
    log.info("assistant turns end with %r (token id %s)", turn_end.text, turn_end.token_id)
    claim_dir(out_dir, plan)
    mine = shards_for_rank(plan["num_shards"], rank, world_size)
    todo = [i for i in mine if shards.finished_shard(out_dir, i, settings.verify_existing) is None]
    log.info("rank %d/%d: %d of %d shards to capture in %s", rank, world_size, len(todo),
             len(mine), out_dir)
    bar = Bar(total=sum(_rows_in(i, plan) for i in todo), unit="sample", disable=not progress,
               desc=f"capture rank {rank}")
    for index in todo:
        lo = index * settings.shard_size
        hi = lo + _rows_in(index, plan)  # rows of a datasets.Dataset or a list of row dicts
        rows = dataset.select(range(lo, hi)) if hasattr(dataset, "select") else dataset[lo:hi]
        samples, report = capture_shard(target, rows, index, settings,
                                        str(source.get("path", "data")), turn_end, server)
        if json.loads((out_dir / shards.PLAN_FILE).read_text()) != plan:  # replaced meanwhile
            raise ValueError(f"{out_dir / shards.PLAN_FILE} changed while this rank was capturing: "
                             "another process runs with different settings; give every rank the "
                             "same settings and data, then rerun")
        shards.write_shard(out_dir, index, samples, settings.hidden_dtype, plan["feature_dim"],
                           report=report)
        bar.count(len(rows), sum(len(s.input_ids) for s in samples), "tok_s")
    bar.close()
    manifest = shards.merge_manifest(out_dir)
    if manifest is None:
        log.info("rank %d done; manifest.json is written by the last rank to finish", rank)
        return None
    per = manifest["loss_tokens_per_sample"]
    log.info("loss tokens per sample: min %d, mean %.1f, max %d (%d samples)", per["min"],
             per["mean"], per["max"], manifest["num_samples"])
    if manifest["num_bad_rows"]:
        log.warning("%d bad rows skipped (listed with their reasons in manifest.json "
                    "bad_rows)", manifest["num_bad_rows"])
    if manifest["num_zero_loss_rows"]:
        log.warning("%d rows had no loss token after truncation and were dropped (manifest.json "
                    "zero_loss_rows); raise capture.max_length to keep them",
                    manifest["num_zero_loss_rows"])
    return manifest


def claim_dir(out_dir: Path, plan: dict[str, Any]) -> None:
    """Write (or match) the capture plan. A plan that no finished shard depends on (a run that
    failed or was killed before finishing one) is replaced, so a failed run never blocks its
    rerun with corrected settings or data; otherwise different settings are refused."""
    path = out_dir / shards.PLAN_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
        if any(out_dir.glob("shard-*.json")):
            if changed:
                details = "; ".join(f"{k}: existing={old.get(k)!r} new={plan.get(k)!r}"
                                    for k in changed)
                raise ValueError(f"{path}: this directory was captured with different settings "
                                 f"({details}); use a new out_dir or delete the old capture")
            return
        if old == plan:
            return
        log.warning("%s: replacing the plan of a run that finished no shard (changed: %s)",
                    path, ", ".join(changed))
    out_dir.mkdir(parents=True, exist_ok=True)
    shards.write_json_atomic(path, plan)


def _rows_in(index: int, plan: dict) -> int:
    return min(plan["shard_size"], plan["num_input_rows"] - index * plan["shard_size"])
