"""The inference proposer (dflash_lab/eval/proposer.py) on long contexts: what a sliding-window
drafter reads. The context-length study in docs/results.md ("Acceptance by context length")
relies on this: a sliding drafter's draft depends on the last W - 1 context positions only
(the window counts the query itself), a full-attention drafter's on all of them."""

import pytest
import torch

from dflash_lab.eval.proposer import DFlashProposer
from tests.eval_doubles import tiny_drafter_for

W, B, CONTEXT = 12, 4, 60


def _draft(tiny_target, layer_type: str, keep: int | None) -> torch.Tensor:
    """Draft logits [B-1, V] after the context's features, or after only its last ``keep``."""
    drafter = tiny_drafter_for(tiny_target, block_size=B, layer_types=[layer_type] * 2,
                               sliding_window=W, seed=3)
    pieces = tiny_target.pieces()
    proposer = DFlashProposer(drafter, pieces.embed_tokens, pieces.lm_head)
    feats = torch.randn(1, CONTEXT, drafter.fc.in_features,
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        proposer.start(feats if keep is None else feats[:, -keep:])
        return proposer.propose(anchor_id=5)


@pytest.mark.parametrize("keep", [W - 1, W + 7])
def test_a_sliding_drafter_reads_only_its_window(tiny_target, keep):
    # RoPE is relative, so dropping the positions before the window changes nothing
    whole, cut = _draft(tiny_target, "sliding_attention", None), \
        _draft(tiny_target, "sliding_attention", keep)
    torch.testing.assert_close(cut, whole, rtol=1e-4, atol=1e-4)


def test_a_full_drafter_reads_the_whole_context(tiny_target):
    whole = _draft(tiny_target, "full_attention", None)
    cut = _draft(tiny_target, "full_attention", W - 1)
    assert (whole - cut).abs().max() > 1e-2


def test_one_position_fewer_than_the_window_changes_a_sliding_draft(tiny_target):
    # the anchor's query (block slot 0) reads the last W - 1 context positions: keeping only
    # W - 2 drops one of them (so the two tests above are not vacuous)
    whole = _draft(tiny_target, "sliding_attention", None)
    cut = _draft(tiny_target, "sliding_attention", W - 2)
    assert (whole - cut).abs().max() > 1e-3
