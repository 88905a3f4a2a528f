"""Sampling rules: unit behaviour and distribution preservation (chi-square on a tiny vocab).

Every statistical test uses a fixed seed, so it is deterministic; the threshold (p > 1e-3) is
what a correct implementation passes for almost every seed, and each test has a broken twin
that the same test rejects (showing it has power).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from dflash_lab.eval.loop import DecodeSettings, speculative_generate
from dflash_lab.eval.sampling import (
    check_sampling,
    leading_matches,
    propose,
    rejection_sample,
    verify,
)
from tests.eval_doubles import MarkovProposer, MarkovTarget

V = 4




def chi_square_pvalue(counts: list[int], probs: list[float]) -> float:
    """Pearson chi-square goodness of fit p-value (df = cells - 1)."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    df = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_helper():
    assert chi_square_pvalue([250, 250, 250, 250], [0.25] * 4) == pytest.approx(1.0)
    assert chi_square_pvalue([400, 200, 200, 200], [0.25] * 4) < 1e-6


def test_greedy_verify_and_matches():
    logits = torch.full((4, V), -5.0)
    logits[torch.arange(4), torch.tensor([1, 2, 3, 0])] = 5.0
    assert verify(torch.tensor([1, 2, 0]), None, logits, 0.0, "exact_match", None) == (2, 3)
    assert verify(torch.tensor([1, 2, 3]), None, logits, 0.0, "rejection", None) == (3, 0)
    assert verify(torch.tensor([0, 2, 3]), None, logits, 0.0, "exact_match", None) == (0, 1)
    assert leading_matches(torch.tensor([1, 1, 0]), torch.tensor([1, 1, 1])) == 2


def test_propose_modes():
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0]])
    assert propose(logits, 0.0, "rejection", None)[1] is None
    assert propose(logits, 1.0, "exact_match", None)[0].tolist() == [1]
    tokens, q = propose(logits, 1.0, "rejection", torch.Generator().manual_seed(0))
    assert q is not None and torch.allclose(q.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match="sampling="):
        check_sampling(1.0, "typical")
    with pytest.raises(ValueError, match="temperature="):
        check_sampling(-1.0, "rejection")


def _probs(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(rows, V, generator=g), dim=-1)


def test_rejection_sample_first_token_is_target_distributed():
    """The first emitted token (draft 1 if kept, else the residual sample) ~ p[0]."""
    p, q = _probs(1, 3), _probs(2, 2)
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(20000):
        drafts = torch.multinomial(q, 1, generator=g).view(-1)
        accepted, bonus = rejection_sample(drafts, q, p, g)
        counts[int(drafts[0]) if accepted >= 1 else bonus] += 1
    assert chi_square_pvalue([counts[v] for v in range(V)], p[0].tolist()) > 1e-3
    # broken twin: emitting the draft unconditionally gives q[0], which the test rejects
    drafted = Counter(torch.multinomial(q[0], 20000, replacement=True, generator=g).tolist())
    assert chi_square_pvalue([drafted[v] for v in range(V)], p[0].tolist()) < 1e-6


def _markov_counts(mode: str, n: int, num_tokens: int, block: int, seed: int,
                   target_table: torch.Tensor, draft_tables: torch.Tensor) -> Counter:
    target, proposer = MarkovTarget(target_table.log()), MarkovProposer(draft_tables.log())
    assert proposer.block_size == block
    settings = DecodeSettings(max_new_tokens=num_tokens, temperature=1.0, sampling=mode)
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(speculative_generate(target, proposer, [0], settings, g).output_ids)
                   for _ in range(n))


def _markov_probs(table: torch.Tensor, num_tokens: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=num_tokens):
        prob, prev = 1.0, 0
        for tok in seq:
            prob, prev = prob * float(table[prev, tok]), tok
        out[seq] = prob
    return out


@pytest.mark.parametrize("mode", ["exact_match", "rejection"])
def test_loop_preserves_target_distribution(mode):
    """Joint law of the first 3 tokens through the real loop (block 3, so rounds accept 0..2
    drafts and crop) equals the toy target's Markov chain; the drafter is deliberately off."""
    table = _probs(3, V)  # row = current token
    drafts = torch.stack([_probs(4, V), _probs(5, V)])  # slot t's q given the anchor
    counts = _markov_counts(mode, 6000, 3, 3, seed=7, target_table=table, draft_tables=drafts)
    expected = _markov_probs(table, 3)
    keys = sorted(expected)
    assert chi_square_pvalue([counts[k] for k in keys], [expected[k] for k in keys]) > 1e-3
    # broken twin: the same counts against a different chain are rejected
    other = _markov_probs(_probs(6, V), 3)
    assert chi_square_pvalue([counts[k] for k in keys], [other[k] for k in keys]) < 1e-6


def test_rejection_accepts_more_than_exact_match():
    """Same drafter and target: rejection sampling keeps more drafts per round on average."""
    table = _probs(3, V)
    drafts = torch.stack([table, table])  # a drafter that knows slot 1's distribution

    def tau(mode: str) -> float:
        target, proposer = MarkovTarget(table.log()), MarkovProposer(drafts.log())
        settings = DecodeSettings(max_new_tokens=40, temperature=1.0, sampling=mode)
        g = torch.Generator().manual_seed(0)
        lengths = [n for _ in range(100)
                   for n in speculative_generate(target, proposer, [0], settings,
                                                 g).acceptance_lengths]
        return sum(lengths) / len(lengths)

    assert tau("rejection") > tau("exact_match") + 0.1


def test_default_sampling_is_rejection():
    """T > 0 defaults to rejection sampling (z-lab's released loop), in the dataclass and the
    eval config alike (issue 17 item 7)."""
    from omegaconf import OmegaConf

    from dflash_lab.paths import CONF_DIR

    assert DecodeSettings().sampling == "rejection"
    assert OmegaConf.load(CONF_DIR / "eval.yaml").sampling == "rejection"
