"""Speculative decoding with a DFlash drafter, and the plain target decoding it must reproduce.
One round (dflash.md section 1): draft from the cached context and the anchor, verify with ONE
target forward, commit the matching drafts plus the bonus token, crop the target cache, extend the
drafter context. Round for round as z-lab's ``dflash_generate`` (tests/eval/test_dflash2.py); the
budget, stop token and DFlash 2 unary acceptance lengths: docs/eval.md, "The loop".

Shape legend: P prompt length, F features, V vocab. Batch size 1 (one prompt at a time)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash_lab.eval.proposer import Proposer, draft_block, max_drafts
from dflash_lab.eval.sampling import leading_matches, probs_at, sample_from, verify
from dflash_lab.eval.target_runner import TargetRunner


@dataclass
class DecodeSettings:
    """Decoding settings shared by the speculative run and its baseline."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    sampling: str = "rejection"  #: T > 0 only: rejection (z-lab's loop) | exact_match
    stop_token_ids: tuple[int, ...] = ()  #: generation ends after emitting one of these


@dataclass
class Generation:
    """One prompt's result. Times in seconds; ``acceptance_lengths`` one entry per round."""

    output_ids: list[int]
    seconds: float
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    #: DFlash 2 at T = 0: per round, the unary argmax draft's acceptance length (else None)
    unary_acceptance_lengths: list[int] | None = None
    #: time to the first output token (prefill + its sampling); decode time = seconds - this
    ttft_seconds: float | None = None


#: torch's own thread count at start-up: the physical cores, or OMP_NUM_THREADS when set.
TORCH_DEFAULT_THREADS = torch.get_num_threads()
#: ``threads=auto`` uses at most this many: one prompt's decode is a batch of 1 (verify: B
#: tokens), too small to gain much beyond a few threads.
MAX_AUTO_THREADS = 4


def set_threads(option: int | str) -> int:
    """Set torch's CPU threads for the timed loops (``threads``, conf/eval.yaml) and return it: an
    int >= 1, or ``auto`` = min(:data:`TORCH_DEFAULT_THREADS`, :data:`MAX_AUTO_THREADS`, CPUs left
    idle by the 1-minute load average), at least 1: a thread on a busy core stalls the others at
    every op (2 threads on 2 busy cores: 15-20x slower per forward; docs/eval.md, Timing)."""
    if option == "auto":
        idle = int((os.cpu_count() or 1) - os.getloadavg()[0])
        n = max(1, min(TORCH_DEFAULT_THREADS, MAX_AUTO_THREADS, idle))
    elif isinstance(option, int) and not isinstance(option, bool) and option >= 1:
        n = option
    else:
        raise ValueError(f"threads={option!r}: use auto or an int >= 1 (the CPU threads of the "
                         "timed loops, conf/eval.yaml; docs/eval.md, Timing)")
    torch.set_num_threads(n)
    return n


def machine_load(timing: dict) -> dict:
    """``timing`` with the 1/5/15-minute load average appended to ``load_average`` (before and
    after the timed loops) and, when more threads were runnable than CPUs (``os.cpu_count``), a
    ``warning``: the timings (and speedup) then measure the contention as much as decoding."""
    load = [round(x, 2) for x in os.getloadavg()]
    cpus = os.cpu_count() or 1
    timing = {**timing, "cpus": cpus, "load_average": [*timing.get("load_average", []), load]}
    if load[0] > cpus:
        timing["warning"] = (
            f"load average {load[0]} > {cpus} CPUs: other processes competed for the cores, so "
            "TTFT, TPOT and the speedup are unreliable; rerun on an idle machine (or with fewer "
            "threads=)")
    return timing


class Clock:
    """perf_counter that first waits for queued GPU work, so timings cover the work itself."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _keep(new_ids: list[int], budget: int, stop_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """Cut ``new_ids`` to the token budget and after the first stop; returns (kept, finished)."""
    kept = new_ids[:budget]
    for i, tok in enumerate(kept):
        if tok in stop_ids:
            return kept[:i + 1], True
    return kept, len(kept) >= budget


def _first_token(logits_1v: Tensor, settings: DecodeSettings, generator) -> int:
    if settings.temperature == 0:
        return int(logits_1v[-1].argmax())
    return int(sample_from(probs_at(logits_1v[-1:], settings.temperature), generator)[0])


def unary_lengths(output_ids: list[int], rounds: list[tuple[int, list[int]]]) -> list[int]:
    """Acceptance lengths of drafts scored against the committed output: ``rounds`` holds
    (index of the round's anchor in ``output_ids``, its drafts); a round's length is
    1 + leading drafts equal to the next outputs, at most the outputs left after the anchor."""
    lengths = []
    for i, drafts in rounds:
        following = output_ids[i + 1:i + 1 + len(drafts)]
        accepted = leading_matches(torch.tensor(drafts[:len(following)]), torch.tensor(following))
        lengths.append(min(accepted + 1, len(output_ids) - 1 - i))
    return lengths


@torch.no_grad()
def speculative_generate(target: TargetRunner, proposer: Proposer, prompt_ids: list[int],
                         settings: DecodeSettings, generator: torch.Generator | None = None,
                         ) -> Generation:
    """Generate up to ``max_new_tokens`` tokens for one prompt with draft-and-verify rounds."""
    clock = Clock(target.device)
    start = clock()
    target.reset()
    prefill = target.forward(torch.tensor(prompt_ids), last_only=True)
    proposer.start(prefill.features_nf)
    out, done = _keep([_first_token(prefill.logits_nv, settings, generator)],
                      settings.max_new_tokens, settings.stop_token_ids)
    result = Generation(out, 0.0, ttft_seconds=clock() - start)
    unary_rounds: list[tuple[int, list[int]]] = []
    while not done:
        anchor_pos = target.length  # = len(prompt) + len(out) - 1 = proposer.context_length
        assert anchor_pos == proposer.context_length, "target and drafter contexts diverged"
        t0 = clock()
        num_drafts = min(max_drafts(proposer), settings.max_new_tokens - len(out))
        draft = draft_block(proposer, out[-1], num_drafts, settings.temperature,
                            settings.sampling, generator)
        drafts = draft.tokens
        t1 = clock()
        block = torch.cat([torch.tensor([out[-1]], device=drafts.device), drafts])
        step = target.forward(block)
        verdict = verify(drafts, draft.probs, step.logits_nv, settings.temperature,
                         settings.sampling, generator)
        target.crop(anchor_pos + verdict.accepted + 1)
        t2 = clock()
        if draft.unary_tokens is not None:
            unary_rounds.append((len(out) - 1, draft.unary_tokens.tolist()))
        new = drafts[:verdict.accepted].tolist() + [verdict.bonus]
        kept, done = _keep(new, settings.max_new_tokens - len(out), settings.stop_token_ids)
        out.extend(kept)
        if not done:  # features of the anchor and the accepted drafts
            proposer.extend(step.features_nf[:, :verdict.accepted + 1])
        t3 = clock()
        result.acceptance_lengths.append(len(kept))
        result.draft_seconds.append((t1 - t0) + (t3 - t2))
        result.verify_seconds.append(t2 - t1)
    result.seconds = clock() - start
    if unary_rounds and settings.temperature == 0:
        result.unary_acceptance_lengths = unary_lengths(out, unary_rounds)
    return result


@torch.no_grad()
def baseline_generate(target: TargetRunner, prompt_ids: list[int], settings: DecodeSettings,
                      generator: torch.Generator | None = None) -> Generation:
    """Plain decoding with the target alone: one forward per token, same stopping rules."""
    clock = Clock(target.device)
    start = clock()
    target.reset()
    logits = target.forward(torch.tensor(prompt_ids), last_only=True).logits_nv
    out: list[int] = []
    done, ttft = False, None
    while not done:
        kept, done = _keep([_first_token(logits, settings, generator)],
                           settings.max_new_tokens - len(out), settings.stop_token_ids)
        out.extend(kept)
        ttft = clock() - start if ttft is None else ttft
        if not done:
            logits = target.forward(torch.tensor(out[-1:]), last_only=True).logits_nv
    return Generation(out, clock() - start, ttft_seconds=ttft)
