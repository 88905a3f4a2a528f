"""Draft proposal and verification rules of one speculative round, all lossless with respect to
the target (docs/eval.md, "The loop"): ``greedy`` (T = 0: accept while the drafter's argmax
equals the target's; output = plain greedy decoding), ``exact_match`` (T > 0: argmax drafts
against the target's own samples, rejection sampling with a one-hot q: vLLM 0.32's default
``draft_sample_method: greedy``) and ``rejection`` (T > 0, the default; Leviathan et al. 2023,
z-lab's ``dflash_generate``, vLLM's ``probabilistic``: accept x ~ q with min(1, p(x) / q(x));
the bonus from norm(max(0, p - q)), or from p after a full block). A head with its own walk
(``Head.draft``: DFlash 2's selector, DSpark's Markov walk) gives its tokens and the q each was
drawn from, and the rules run unchanged with that q, so they stay lossless.

Shape legend: k drafts in a round (= block size - 1), V vocab. ``p``/``q`` are probabilities at
the sampling temperature, float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

SAMPLING_MODES = ("exact_match", "rejection")


class Verdict(NamedTuple):
    """``accepted``: number of leading drafts kept (0..k); ``bonus``: the target's next token."""

    accepted: int
    bonus: int


def check_sampling(temperature: float, mode: str) -> None:
    """ValueError for a negative temperature or an unknown mode (names the config keys)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling={mode!r}: use one of {list(SAMPLING_MODES)} "
                         "(used only when temperature > 0)")


def probs_at(logits_kv: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) in float32 [k, V] (T > 0)."""
    return torch.softmax(logits_kv.float() / temperature, dim=-1)


def sample_from(probs_kv: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs_kv`` [k, V] -> [k] int64."""
    return torch.multinomial(probs_kv, 1, generator=generator).view(-1)


def leading_matches(draft_k: Tensor, choice_k: Tensor) -> int:
    """Number of leading positions where the draft equals the target's choice."""
    return int((draft_k == choice_k).long().cumprod(0).sum())


def propose(draft_logits_kv: Tensor, temperature: float, mode: str,
            generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """Draft tokens [k] (and q [k, V] for rejection sampling, else None). Greedy and exact-match
    drafting take the drafter's argmax: the most likely token to match."""
    if temperature > 0 and mode == "rejection":
        q = probs_at(draft_logits_kv, temperature)
        return sample_from(q, generator), q
    return draft_logits_kv.argmax(-1), None


def verify(draft_k: Tensor, draft_probs_kv: Tensor | None, target_logits_kv: Tensor,
           temperature: float, mode: str, generator: torch.Generator | None) -> Verdict:
    """Apply the round's verification rule. ``target_logits_kv`` [k + 1, V]: row t is the target's
    distribution at draft t's position (row k: after the last). Returns drafts kept and bonus."""
    p = None if temperature == 0 else probs_at(target_logits_kv, temperature)
    if p is None or mode == "exact_match":  # drafts against the target's argmax or own samples
        choice = target_logits_kv.argmax(-1) if p is None else sample_from(p, generator)
        accepted = leading_matches(draft_k, choice[:-1])
        return Verdict(accepted, int(choice[accepted]))
    if draft_probs_kv is None:
        raise ValueError("rejection sampling needs the drafter's probabilities q")
    return rejection_sample(draft_k, draft_probs_kv, p, generator)


def rejection_sample(draft_k: Tensor, q_kv: Tensor, p_kv: Tensor,
                     generator: torch.Generator | None) -> Verdict:
    """Leviathan et al. speculative sampling for one block: draft_k [k] from q_kv [k, V]; p_kv
    [k + 1, V] the target's. Draft t is kept iff u_t < p_t(x_t) / q_t(x_t) (u_t uniform) for it
    and every draft before it."""
    k = draft_k.shape[0]
    rows = torch.arange(k, device=draft_k.device)
    p_x = p_kv[rows, draft_k]
    q_x = q_kv[rows, draft_k]
    u = torch.rand(k, generator=generator, device=p_kv.device)
    accepted = int((u * q_x < p_x).long().cumprod(0).sum())
    if accepted == k:
        return Verdict(k, int(sample_from(p_kv[k:], generator)[0]))
    residual = (p_kv[accepted] - q_kv[accepted]).clamp_min(0)
    total = residual.sum()
    # total == 0 only when p == q at this slot, where a rejection has probability 0; guard anyway.
    dist = residual / total if total > 0 else p_kv[accepted]
    return Verdict(accepted, int(sample_from(dist[None], generator)[0]))
