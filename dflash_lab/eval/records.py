"""One record per response (a prompt, or one turn of a multi-turn dataset), whatever produced it
(the offline loop or a serving engine), and the metrics every report derives from them: the two
tau conventions ``tau_macro`` and ``tau_pooled``, TTFT, TPOT and ``decode_speedup`` as the
reference's ``dflash_generate`` times them (docs/eval.md, "Report").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


@dataclass
class ResponseRecord:
    """One response's acceptance and timing (seconds). Lengths count the tokens a verify round
    committed (accepted drafts + the bonus, cut at the budget and the first stop token)."""

    dataset: str
    index: int  #: row index in the dataset (before the shuffle)
    turn: int = 0  #: 0-based turn of a multi-turn row
    num_output_tokens: int = 0
    acceptance_lengths: list[int] | None = None  #: per round; None when only totals are known
    num_rounds: int | None = None  #: verify rounds (derived from acceptance_lengths if given)
    num_round_tokens: int | None = None  #: tokens from rounds (= sum of acceptance_lengths)
    ttft_s: float | None = None
    tpot_s: float | None = None
    baseline_ttft_s: float | None = None
    baseline_tpot_s: float | None = None
    lossless: bool | None = None  #: T = 0 with a baseline: output == baseline output
    prompt_tokens: int | None = None  #: the turn's prompt length (its context before round 1)

    def __post_init__(self):
        if self.acceptance_lengths is not None:
            self.num_rounds = len(self.acceptance_lengths)
            self.num_round_tokens = sum(self.acceptance_lengths)

    @property
    def tau(self) -> float | None:
        """Mean tokens per round of this response (None without a round)."""
        return self.num_round_tokens / self.num_rounds if self.num_rounds else None


def _tpot(gen) -> float | None:
    """Decode seconds per output token, as dflash_generate's time_per_output_token."""
    if gen is None or gen.ttft_seconds is None or not gen.output_ids:
        return None
    return (gen.seconds - gen.ttft_seconds) / len(gen.output_ids)


def record_from_generation(dataset: str, index: int, turn: int, spec, base=None,
                           greedy: bool = True, prompt_tokens: int | None = None
                           ) -> ResponseRecord:
    """The record of one offline response (``spec``/``base``: loop Generations)."""
    return ResponseRecord(prompt_tokens=prompt_tokens,
        dataset=dataset, index=index, turn=turn, num_output_tokens=len(spec.output_ids),
        acceptance_lengths=list(spec.acceptance_lengths), ttft_s=spec.ttft_seconds,
        tpot_s=_tpot(spec), baseline_ttft_s=None if base is None else base.ttft_seconds,
        baseline_tpot_s=_tpot(base),
        lossless=(spec.output_ids == base.output_ids) if (greedy and base is not None) else None)


def mean_of(values: list[float | None]) -> float | None:
    """The mean of the values that are not None (None when there is none)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of acceptance length 1..B (index 0 = length 1)."""
    counts = [0] * block_size
    for n in lengths:
        counts[min(max(n, 1), block_size) - 1] += 1
    return counts


def per_position_acceptance(lengths: list[int], block_size: int) -> list[float | None]:
    """Fraction of rounds that accepted at least t drafts (length >= t + 1), t = 1..B-1."""
    if not lengths:
        return [None] * (block_size - 1)
    return [sum(n >= t + 1 for n in lengths) / len(lengths) for t in range(1, block_size)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def summarize(records: list[ResponseRecord], block_size: int) -> dict[str, Any]:
    """One dataset row: both taus, the pooled histogram and curve, TTFT/TPOT, decode speedup.
    Histogram and curve pool the records that carry per-round lengths."""
    pooled = [n for r in records for n in (r.acceptance_lengths or [])]
    rounds = sum(r.num_rounds or 0 for r in records)
    round_tokens = sum(r.num_round_tokens or 0 for r in records)
    tpot = mean_of([r.tpot_s for r in records])
    base_tpot = mean_of([r.baseline_tpot_s for r in records])
    checked = [r.lossless for r in records if r.lossless is not None]
    return {
        "num_responses": len(records),
        "num_rounds": rounds,
        "num_output_tokens": sum(r.num_output_tokens for r in records),
        "tau_macro": mean_of([r.tau for r in records]),  # over responses with a round
        "tau_pooled": round_tokens / rounds if rounds else None,  # all round tokens / all rounds
        "acceptance_histogram": histogram(pooled, block_size),
        "per_position_acceptance": per_position_acceptance(pooled, block_size),
        "ttft_ms": _ms(mean_of([r.ttft_s for r in records])),
        "tpot_ms": _ms(tpot),
        "baseline_ttft_ms": _ms(mean_of([r.baseline_ttft_s for r in records])),
        "baseline_tpot_ms": _ms(base_tpot),
        "decode_speedup": base_tpot / tpot if tpot and base_tpot else None,
        "lossless": all(checked) if checked else None,
    }


def per_dataset(records: list[ResponseRecord], block_size: int) -> dict[str, dict[str, Any]]:
    """{dataset: summarize(its records)} in first-seen order."""
    names = list(dict.fromkeys(r.dataset for r in records))
    return {n: summarize([r for r in records if r.dataset == n], block_size) for n in names}


#: Context-length bucket edges (tokens) of ``dflash-eval``'s acceptance by context length.
CONTEXT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def bucket_name(edges: tuple[int, ...], i: int) -> str:
    lo = 0 if i == 0 else edges[i - 1]
    return f"{lo}-{edges[i] - 1}" if i < len(edges) else f">={lo}"


def tau_by_context(records: list[ResponseRecord], edges=CONTEXT_BUCKETS) -> list[dict[str, Any]]:
    """Acceptance by context length: each verify round counted in the bucket of the context the
    drafter read (the turn's prompt + the tokens committed before the round). A record with
    totals only (an engine's server) counts its rounds at its prompt length (``basis``
    responses: coarser); records without ``prompt_tokens`` are left out. One row per bucket
    that holds a round: bucket, rounds, tokens, tau (tokens per round), basis."""
    edges = tuple(sorted(int(e) for e in edges))
    rows = [{"rounds": 0, "tokens": 0, "bases": set()} for _ in range(len(edges) + 1)]

    def add(context: int, rounds: int, tokens: int, basis: str) -> None:
        row = rows[bisect.bisect_right(edges, context)]
        row["rounds"] += rounds
        row["tokens"] += tokens
        row["bases"].add(basis)

    for r in records:
        if r.prompt_tokens is None:
            continue
        if r.acceptance_lengths is not None:
            context = r.prompt_tokens
            for n in r.acceptance_lengths:
                add(context, 1, n, "rounds")
                context += n
        elif r.num_rounds:
            add(r.prompt_tokens, r.num_rounds, r.num_round_tokens or 0, "responses")
    return [{"context": bucket_name(edges, i), "rounds": row["rounds"], "tokens": row["tokens"],
             "tau": row["tokens"] / row["rounds"], "basis": "+".join(sorted(row["bases"]))}
            for i, row in enumerate(rows) if row["rounds"]]


def context_buckets(cfg) -> list[int]:
    """``context_buckets`` of an eval config: increasing positive token counts (ValueError
    naming the setting otherwise; default :data:`CONTEXT_BUCKETS`)."""
    given = cfg.get("context_buckets")
    edges = list(CONTEXT_BUCKETS) if given is None else [int(e) for e in given]
    if not edges or any(e < 1 for e in edges) or edges != sorted(set(edges)):
        raise ValueError(f"context_buckets={list(given)}: give increasing token counts >= 1, "
                         "e.g. [1024, 4096, 16384] (conf/eval.yaml)")
    return edges
