"""DFlash 2 in dflash-eval: the selector walk, its sampling law, the unary tau beside the selector
path, and z-lab's released loop (``dflash`` 0.1.0 ``dflash_generate``) as the reference.

The DFlash 2 drafters here start from a briefly trained DFlash 1 drafter (tests/eval/test_trained,
so rounds accept more than one token) with non-identity conv and selector weights, so the walk
picks other tokens than the unary argmax in some rounds.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_lab.eval.loading import load_drafter
from dflash_lab.eval.loop import (
    DecodeSettings,
    Generation,
    baseline_generate,
    speculative_generate,
    unary_lengths,
)
from dflash_lab.eval.offline_tau import _forward, feature_eval
from dflash_lab.eval.prompts import encode_prompt
from dflash_lab.eval.proposer import DFlashProposer
from dflash_lab.eval.report import generation_report, markdown
from dflash_lab.eval.target_runner import StepOutput, TargetRunner
from dflash_lab.heads.dflash2 import selector_flags
from dflash_lab.model.config import DrafterConfig
from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.paths import REPO_ROOT
from dflash_lab.targets.chat import target_stop_ids
from dflash_lab.targets.demo_corpus import demo_conversations
from dflash_lab.train.loss import acceptance_lengths
from tests.eval.test_sampling import chi_square_pvalue
from tests.eval.test_trained import _as_capture, quick_train
from tests.eval_doubles import MarkovTarget, tiny_drafter_for
from tests.model.test_dflash2 import selector_scores

ZLAB_PYTHON = REPO_ROOT / ".venv-dflash" / "bin" / "python"
B = 6  # quick_train's block size
TRAIN_STEPS = 60
V2 = {"variant": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
      "selector_top_k": 4}
#: max_new_tokens of the z-lab comparison: some prompts stop at <|im_end|>, some at the budget
ZLAB_BUDGET = 24


def _config(drafter: DFlashDrafter, **changes) -> DrafterConfig:
    fields = {k: getattr(drafter.config, k) for k in DrafterConfig.field_names()}
    return DrafterConfig.create(source="test_eval_dflash2", **{**fields, **changes})


def perturb_v2(drafter: DFlashDrafter, seed: int = 0, successor_std: float = 0.5) -> None:
    """Conv taps off the identity (std 0.05) and a selector that re-ranks (successor codebook
    std ``successor_std``; 0 keeps scores = unary logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "conv" in name:
                p.add_(0.05 * noise)
            elif "successor" in name:
                p.copy_(successor_std * noise)
            elif "predecessor" in name:
                p.copy_(noise)
            elif "hidden_projection" in name:
                p.copy_(0.2 * noise)


def as_dflash2(trained: DFlashDrafter, successor_std: float = 0.5, **changes) -> DFlashDrafter:
    """A DFlash 2 drafter with ``trained``'s DFlash 1 weights and perturbed conv/selector."""
    drafter = DFlashDrafter(_config(trained, **V2, **changes)).eval()
    missing = drafter.load_state_dict(trained.state_dict(), strict=False).missing_keys
    assert all("conv" in k or "candidate_selector" in k for k in missing), missing
    perturb_v2(drafter, successor_std=successor_std)
    return drafter.requires_grad_(False)


@pytest.fixture(scope="module")
def trained(tiny_target):
    return quick_train(tiny_target, steps=TRAIN_STEPS)


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [encode_prompt(tiny_target.tokenizer, conv[:1])
            for conv in demo_conversations(6, seed=41)]


def _generate(target, drafter, prompts, settings) -> list[Generation]:
    pieces = target.pieces()
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    runner = TargetRunner(target.model, drafter.config.target_layer_ids)
    return [speculative_generate(runner, proposer, ids, settings) for ids in prompts]


# ---------------------------------------------------------------------------- proposer
def _context(drafter: DFlashDrafter, n: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, drafter.fc.in_features, generator=g)


def test_tail_round_runs_a_shorter_block(tiny_target):
    """Near the budget a round drafts with a block of num_drafts + 1 slots (as z-lab's loop):
    the same tokens and unary argmax as a drafter built for that block size, not the first slots
    of a full block (bidirectional attention and the conv see the missing slots)."""
    pieces = tiny_target.pieces()
    drafter = tiny_drafter_for(tiny_target, block_size=B, **V2)
    perturb_v2(drafter)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    short = DFlashDrafter(_config(drafter, block_size=3)).eval()
    short.load_state_dict(drafter.state_dict())
    ctx = _context(drafter)
    proposer.start(ctx)
    cache = short.new_cache()
    short.extend_context(cache, ctx)
    for anchor in (5, 17, 40):
        draft = proposer.draft(anchor, 2, 0.0, "exact_match", None)
        hidden = short.draft(cache, torch.tensor([anchor]), pieces.embed_tokens)
        assert draft.tokens.tolist() == short.propose(hidden, torch.tensor([anchor]),
                                                      pieces.lm_head)[0].tolist()
        unary = short.unary_logits(hidden[0, 1:], pieces.lm_head).argmax(-1)
        assert draft.unary_tokens.tolist() == unary.tolist()
        full = proposer._hidden(anchor, B)
        assert not torch.allclose(full[:3], hidden[0], atol=1e-4)
    assert proposer.context_length == ctx.shape[1]  # drafting never grows the context


def test_conv_longer_than_tail_block(tiny_target):
    """A 4-tap conv cannot run on 2 slots (z-lab's loop fails there too): a 1-draft tail round
    uses the shortest block it runs on (3 slots), and a user block_size below that is refused."""
    pieces = tiny_target.pieces()
    drafter = tiny_drafter_for(tiny_target, block_size=B, **{**V2, "conv_kernel_size": 4})
    perturb_v2(drafter)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    proposer.start(_context(drafter))
    draft = proposer.draft(9, 1, 0.0, "exact_match", None)
    three = proposer.draft(9, 2, 0.0, "exact_match", None)
    assert draft.tokens.tolist() == three.tokens[:1].tolist()
    with pytest.raises(ValueError, match="DFlash 2 drafter runs on blocks of at least 3 slots"):
        DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head, block_size=2)


def test_dflash1_drafts_honour_output_scales(tiny_target):
    """DFlash 1 logits go through unary_logits (output_multiplier, softcap): the T > 0 draft
    distribution q is softmax of the scaled logits."""
    pieces = tiny_target.pieces()
    scales = {"output_multiplier": 0.5, "final_logit_softcapping": 3.0}
    drafter = tiny_drafter_for(tiny_target, block_size=B, **scales)
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    proposer.start(_context(drafter))
    raw = pieces.lm_head(proposer._hidden(7, B)[1:]).float()
    expected = torch.softmax(torch.tanh(raw * 0.5 / 3.0) * 3.0 / 0.7, dim=-1)
    draft = proposer.draft(7, B - 1, 0.7, "rejection", torch.Generator().manual_seed(0))
    torch.testing.assert_close(draft.probs, expected)
    assert draft.unary_tokens is None


def test_unary_lengths_against_the_output():
    out = [5, 1, 2, 3, 9, 4]
    # round at anchor 0 drafted [1, 2, 7] (2 match), anchor 3 drafted [9, 4, 8] (cut at the end)
    assert unary_lengths(out, [(0, [1, 2, 7]), (3, [9, 4, 8]), (4, [0])]) == [3, 2, 1]


# ---------------------------------------------------------------------------- greedy loop
def test_dflash2_greedy_is_lossless_and_reports_unary_tau(tiny_target, trained, prompts):
    settings = DecodeSettings(max_new_tokens=30,
                              stop_token_ids=(tiny_target.tokenizer.eos_token_id,))
    walk = _generate(tiny_target, as_dflash2(trained), prompts, settings)
    plain = _generate(tiny_target, as_dflash2(trained, successor_std=0.0), prompts, settings)
    for ids, w, p in zip(prompts, walk, plain, strict=True):
        base = baseline_generate(TargetRunner(tiny_target.model), ids, settings).output_ids
        assert w.output_ids == base and p.output_ids == base
        assert len(w.unary_acceptance_lengths) == len(w.acceptance_lengths)
        # a zero successor codebook makes the walk the unary argmax: both paths agree
        assert p.unary_acceptance_lengths == p.acceptance_lengths
    assert any(w.unary_acceptance_lengths != w.acceptance_lengths for w in walk)
    assert max(n for w in walk for n in w.acceptance_lengths) > 1


def test_report_shows_selector_and_unary_tau():
    spec = [Generation([1, 2, 3, 4, 5], 1.0, [2, 2], unary_acceptance_lengths=[1, 3])]
    report = generation_report(spec, None, [[0]], 4, {"variant": "dflash2", "block_size": 4,
                                                      "temperature": 0.0})
    assert report["tau_mean"] == report["selector_tau_mean"] == 2.0
    assert report["unary_tau_mean"] == 2.0 and report["unary_acceptance_lengths"] == [[1, 3]]
    assert report["unary_per_position_acceptance"] == [0.5, 0.5, 0.0]
    md = markdown(report)
    assert "| unary_tau_mean | 2.000 |" in md and "| unary | 0.50 | 0.50 | 0.00 |" in md
    sampled = [Generation([1, 2, 3], 1.0, [2])]
    hot = generation_report(sampled, None, [[0]], 4, {"variant": "dflash2", "block_size": 4,
                                                      "temperature": 1.0})
    assert hot["unary_tau_mean"] is None and "| unary |" not in markdown(hot)
    one = generation_report(sampled, None, [[0]], 4, {"variant": "dflash1", "block_size": 4})
    assert "unary_tau_mean" not in one and "selector_tau_mean" not in one


# ---------------------------------------------------------------------------- features mode
def test_features_mode_dflash2_paths(tiny_target, trained, prompts):
    """The simulator's selector path and unary path reproduce the generation rounds (same
    anchors, last round excluded: generation cuts it at the budget), and oracle >= both."""
    drafter = as_dflash2(trained)
    settings = DecodeSettings(max_new_tokens=30)
    pieces = tiny_target.pieces()
    samples, paths_differ = [], False
    for ids, gen in zip(prompts[:3], _generate(tiny_target, drafter, prompts[:3], settings)):
        sample = _as_capture(tiny_target, drafter, ids, gen.output_ids)
        samples.append(sample)
        # round r's anchor: output token sum(lengths[:r]), after the prompt
        starts = [len(ids) + sum(gen.acceptance_lengths[:r])
                  for r in range(len(gen.acceptance_lengths) - 1)]
        hidden, anchor_ids, tgt, out = _forward(drafter, pieces, sample, torch.tensor(starts))
        walk, found = selector_flags(drafter, pieces.lm_head, hidden, anchor_ids, tgt.labels,
                                     out.valid)
        assert acceptance_lengths(walk, out.block_valid).long().tolist() == \
            gen.acceptance_lengths[:-1]
        assert acceptance_lengths(out.correct, out.block_valid).long().tolist() == \
            gen.unary_acceptance_lengths[:-1]
        paths_differ |= not torch.equal(walk, out.correct)
    assert paths_differ  # the selector really re-ranked somewhere
    report = feature_eval(drafter, pieces, samples, progress=False)
    assert report["oracle_tau_mean"] >= max(report["tau_mean"], report["unary_tau_mean"])
    assert 0 < report["recall_at_k"] <= 1 and len(report["recall_per_position"]) == B - 1
    same = feature_eval(as_dflash2(trained, successor_std=0.0), pieces, samples, progress=False)
    assert same["tau_mean"] == same["unary_tau_mean"]


# ---------------------------------------------------------------------------- sampling law
V = 3


class _FeatureMarkov(MarkovTarget):
    """The toy Markov target, with per-token features of width F for a real drafter."""

    def __init__(self, log_probs_vv: torch.Tensor, features_vf: torch.Tensor):
        super().__init__(log_probs_vv)
        self.features = features_vf

    def forward(self, ids_n, last_only=False):
        out = super().forward(ids_n, last_only)
        return StepOutput(out.logits_nv, self.features[ids_n.view(-1)][None])


def _toy_dflash2(seed: int = 0, head_std: float = 0.15, successor_std: float = 2.0):
    """A real DFlash 2 drafter over a 3-token vocabulary, K = 2 candidates (q is 0 on one token
    per slot, so the residual alone must supply it)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.create(
        source="toy", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, vocab_size=V, mask_token_id=2,
        num_target_layers=1, target_layer_ids=[0], block_size=3, variant="dflash2",
        conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=2)
    drafter = DFlashDrafter(cfg).eval().requires_grad_(False)
    perturb_v2(drafter, seed, successor_std=successor_std)
    embed = torch.nn.Embedding(V, 16).requires_grad_(False)
    head = torch.nn.Linear(16, V, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(std=head_std)
    return DFlashProposer(drafter, embed, head), torch.randn(V, 16)


def _probs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(V, V, generator=g), dim=-1)


def test_selector_q_is_the_walk_distribution():
    """q row t = softmax(score_t / T) over slot t's K candidates given the walk's own previous
    pick (scores recomputed with the teacher-forced selector_scores), zero elsewhere."""
    proposer, features = _toy_dflash2()
    proposer.start(features[torch.tensor([0, 2, 1])][None])
    t = 0.8
    for seed in range(5):
        draft = proposer.draft(1, 2, t, "rejection", torch.Generator().manual_seed(seed))
        hidden = proposer._hidden(1, 3)[1:]
        prev = torch.tensor([[1, int(draft.tokens[0])]])
        scores, ids, _ = selector_scores(proposer.drafter, hidden[None], prev,
                                           proposer.lm_head)
        expected = torch.zeros(2, V).scatter_(-1, ids[0], torch.softmax(scores[0] / t, -1))
        torch.testing.assert_close(draft.probs, expected)
        assert (draft.probs > 0).sum(-1).tolist() == [2, 2]
        assert bool((draft.probs.gather(-1, draft.tokens[:, None]) > 0).all())


def test_selector_drafts_follow_their_q():
    """The walk's sampled (slot 1, slot 2) pairs follow q1(x1) * q2(x2 | x1), the q handed to
    rejection sampling (q2 read from a draw with that x1); the unary-only law is rejected."""
    proposer, features = _toy_dflash2()
    proposer.start(features[torch.tensor([0, 2, 1])][None])
    g = torch.Generator().manual_seed(5)
    draws = [proposer.draft(1, 2, 1.0, "rejection", g) for _ in range(1500)]
    counts = Counter(tuple(d.tokens.tolist()) for d in draws)
    q2 = {int(d.tokens[0]): d.probs[1] for d in draws}
    q1 = draws[0].probs[0]
    cells = sorted((a, b) for a in q2 for b in range(V) if q2[a][b] > 0)
    law = [float(q1[a] * q2[a][b]) for a, b in cells]
    assert abs(sum(law) - 1) < 1e-5
    assert chi_square_pvalue([counts[c] for c in cells], law) > 1e-3
    unary = torch.softmax(proposer._unary(proposer._hidden(1, 3)[1:]), -1)
    plain = [float(unary[0, a] * unary[1, b]) for a, b in cells]
    plain = [x / sum(plain) for x in plain]
    assert chi_square_pvalue([counts[c] for c in cells], plain) < 1e-6


def _law_counts(mode: str, n: int, table: torch.Tensor) -> Counter:
    proposer, features = _toy_dflash2()
    target = _FeatureMarkov(table.log(), features)
    settings = DecodeSettings(max_new_tokens=3, temperature=1.0, sampling=mode)
    g = torch.Generator().manual_seed(11)
    return Counter(tuple(speculative_generate(target, proposer, [0], settings, g).output_ids)
                   for _ in range(n))


def _chain(table: torch.Tensor) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=3):
        prob, prev = 1.0, 0
        for tok in seq:
            prob, prev = prob * float(table[prev, tok]), tok
        out[seq] = prob
    return out


def test_dflash2_rejection_sampling_preserves_target_distribution():
    """Joint law of 3 tokens through the real loop with rejection sampling on the selector's q
    (block 3: a 2-slot walk, then a 1-draft tail round) equals the toy target's chain.
    (exact_match drafts the greedy walk: its law is DFlash 1's, tests/eval/test_sampling.py.)"""
    table = _probs(3)
    counts = _law_counts("rejection", 2400, table)
    keys = sorted(_chain(table))
    assert chi_square_pvalue([counts[k] for k in keys], [_chain(table)[k] for k in keys]) > 1e-3
    other = _chain(_probs(6))  # broken twin: another chain is rejected by the same counts
    assert chi_square_pvalue([counts[k] for k in keys], [other[k] for k in keys]) < 1e-6


# ---------------------------------------------------------------------------- z-lab's loop
def _write_zlab_dir(drafter: DFlashDrafter, path: Path) -> Path:
    """The z-lab-format directory: config.json from to_dict(), the state dict's tensors (codebooks
    named without .weight, which z-lab's DFlash2DraftModel loader maps)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()},
              str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def zlab_runs(tiny_target, tiny_target_dir, trained, prompts, tmp_path_factory):
    if not ZLAB_PYTHON.exists():
        pytest.skip("needs .venv-dflash (make dflash-venv): z-lab's released dflash 0.1.0")
    root = tmp_path_factory.mktemp("zlab_loop")
    drafters = {
        "dflash1": DFlashDrafter(_config(trained, input_embedding_scale=1.05)).eval(),
        "dflash2": as_dflash2(trained, output_multiplier=0.8, final_logit_softcapping=8.0),
    }
    drafters["dflash1"].load_state_dict(trained.state_dict())
    dirs = {name: _write_zlab_dir(d, root / name) for name, d in drafters.items()}
    (root / "prompts.json").write_text(json.dumps(prompts))
    proc = subprocess.run(
        [str(ZLAB_PYTHON), "-m", "scripts.zlab_generate",
         "--target", str(tiny_target_dir), "--prompts", str(root / "prompts.json"),
         "--max-new-tokens", str(ZLAB_BUDGET), "--out", str(root / "zlab.json"),
         *(str(d) for d in dirs.values())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    theirs = json.loads((root / "zlab.json").read_text())
    stops = tuple(target_stop_ids(tiny_target))
    assert theirs["stop_token_ids"] == list(stops)  # benchmark.py's rule gives ours here
    settings = DecodeSettings(max_new_tokens=ZLAB_BUDGET, stop_token_ids=stops)
    ours = {name: _generate(tiny_target, load_drafter(path).drafter, prompts, settings)
            for name, path in dirs.items()}
    return {name: (ours[name], theirs["drafters"][str(path)]) for name, path in dirs.items()}


@pytest.mark.parametrize("variant", ["dflash1", "dflash2"])
def test_zlab_loop_matches_round_for_round(zlab_runs, prompts, variant):
    """z-lab's dflash_generate and ours, from the same directory: same greedy outputs and the
    same acceptance length in every round, over prompts that end at the stop token and at the
    budget with a shorter last block."""
    ours, theirs = zlab_runs[variant]
    assert [g.output_ids for g in ours] == theirs["outputs"]
    assert [g.acceptance_lengths for g in ours] == theirs["acceptance_lengths"]
    ends = [len(g.output_ids) < ZLAB_BUDGET for g in ours]
    assert any(ends) and not all(ends), ends  # stop-token ends and budget ends both covered
    left = [ZLAB_BUDGET - 1 - sum(g.acceptance_lengths[:-1]) for g, e in zip(ours, ends) if not e]
    assert min(left) < B - 1, left  # a budget-cut last round ran a shorter block
    assert max(n for g in ours for n in g.acceptance_lengths) > 1
    if variant == "dflash2":
        assert any(g.unary_acceptance_lengths != g.acceptance_lengths for g in ours)
