"""The one mask predicate against hand-computed tables and every past bug of dflash.md sec. 3."""

import pytest
import torch

from dflash_lab.attention.mask import (
    BlockLayout,
    LayerSpec,
    dense_mask,
    document_starts,
    flash_window_args,
    is_inference_layout,
)
from tests.doubles import flash_window_mask

# S = 6 context slots, B = 3, anchors at 2 and 4 (blocks overlap in position 4).
# Key columns: context 0..5 | block 0 slots 0..2 | block 1 slots 0..2.
LAYOUT = BlockLayout(torch.tensor([[2, 4]]), num_context=6, block_size=3)

TABLES = {
    LayerSpec(None, False): [  # full, bidirectional
        "110000 111 000", "110000 111 000", "110000 111 000",
        "111100 000 111", "111100 000 111", "111100 000 111",
    ],
    LayerSpec(None, True): [  # full, causal
        "110000 100 000", "110000 110 000", "110000 111 000",
        "111100 000 100", "111100 000 110", "111100 000 111",
    ],
    LayerSpec(3, True): [  # sliding W=3 causal: query pos a+t sees p >= a+t-2
        "110000 100 000", "010000 110 000", "000000 111 000",
        "001100 000 100", "000100 000 110", "000000 000 111",
    ],
    LayerSpec(2, False): [  # sliding W=2 bidirectional: symmetric window (1, 1)
        "010000 110 000", "000000 111 000", "000000 011 000",
        "000100 000 110", "000000 000 111", "000000 000 011",
    ],
}


def _as_rows(mask):
    rows = []
    for row in mask[0, 0].int().tolist():
        bits = "".join(map(str, row))
        rows.append(f"{bits[:6]} {bits[6:9]} {bits[9:]}")
    return rows


@pytest.mark.parametrize("spec", list(TABLES), ids=str)
def test_mask_matches_hand_computed_table(spec):
    assert _as_rows(dense_mask(LAYOUT, spec)) == TABLES[spec]


ALL_SPECS = [LayerSpec(w, c) for w in (None, 2, 3, 8) for c in (False, True)]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_bug_context_never_includes_the_anchor_or_later(spec):
    layout = BlockLayout(torch.tensor([[1, 3, 4, 9]]), num_context=12, block_size=4)
    mask = dense_mask(layout, spec)[0, 0]
    for q in range(layout.num_queries):
        anchor = layout.anchors_bn[0, q // 4].item()
        assert not mask[q, anchor:12].any(), f"query {q} sees context at/after anchor {anchor}"


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_bug_overlapping_blocks_do_not_leak(spec):
    """Visibility is decided by the anchor position, never by the block index."""
    layout = BlockLayout(torch.tensor([[5, 6, 7]]), num_context=12, block_size=4)
    mask = dense_mask(layout, spec)[0, 0]
    block0 = mask[0:4]
    assert not block0[:, 5:12].any()  # positions 5.. are future for anchor 5
    assert not block0[:, 12 + 4:].any()  # other blocks' slots, although they overlap in position


@pytest.mark.parametrize("causal", [False, True])
def test_bug_window_is_counted_from_each_query_including_itself(causal):
    w, anchor, b = 5, 8, 4
    layout = BlockLayout(torch.tensor([[anchor]]), num_context=10, block_size=b)
    mask = dense_mask(layout, LayerSpec(w, causal))[0, 0]
    for t in range(b):
        expected = [p for p in range(10) if p < anchor and (anchor + t) - p <= w - 1]
        got = mask[t, :10].nonzero().flatten().tolist()
        assert got == expected, f"slot {t}: window measured from the anchor?"
    # a window measured from the anchor would give every slot the same 4 keys
    assert mask[0, :10].sum() != mask[3, :10].sum()


def test_padded_context_is_invisible_through_the_anchor():
    """Row 1 has only 5 real positions; its anchors stay inside, so pads are never seen."""
    layout = BlockLayout(torch.tensor([[3, 8], [1, 4]]), num_context=10, block_size=2)
    mask = dense_mask(layout, LayerSpec(None, False))
    assert not mask[1, 0, :, 5:10].any()
    assert mask.sum(-1).min() > 0  # no empty softmax row


@pytest.mark.parametrize("spec", ALL_SPECS + [LayerSpec(1, False), LayerSpec(1, True)], ids=str)
@pytest.mark.parametrize("context", [1, 3, 11])
def test_flash_window_args_equal_the_predicate_on_the_inference_layout(spec, context):
    b = 4
    layout = BlockLayout(torch.tensor([[context]]), num_context=context, block_size=b)
    assert is_inference_layout(layout)
    window, causal = flash_window_args(spec)
    emulated = flash_window_mask(b, context + b, window, causal)
    assert torch.equal(dense_mask(layout, spec)[0, 0], emulated)


def test_flash_window_args_convention():
    assert flash_window_args(LayerSpec(None, False)) == ((-1, -1), False)
    assert flash_window_args(LayerSpec(2048, True)) == ((2047, 0), True)
    assert flash_window_args(LayerSpec(2048, False)) == ((2047, 2047), False)


# Packed rows: documents [0, 5) and [5, 12) in row 0, one document [0, 9) and padding in row 1.
DOC_IDS = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])


def test_document_starts_and_positions_restart_per_document():
    starts = document_starts(DOC_IDS)
    assert starts.tolist() == [[0] * 5 + [5] * 7, [0] * 9 + [9] * 3]
    positions = torch.arange(12) - starts
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_packed_context_never_crosses_a_document_boundary(spec):
    """Brute force: a context key is visible iff the unpacked rule holds AND it lies in the
    anchor's document; block keys are unchanged."""
    anchors = torch.tensor([[2, 4, 5, 7, 11], [1, 3, 6, 8, 8]])
    starts = document_starts(DOC_IDS)
    packed = BlockLayout(anchors, 12, 4, doc_starts_bn=starts.gather(1, anchors))
    plain = dense_mask(BlockLayout(anchors, 12, 4), spec)
    mask = dense_mask(packed, spec)
    for row in range(2):
        for q in range(packed.num_queries):
            a = int(anchors[row, q // 4])
            same_doc = DOC_IDS[row, :12] == DOC_IDS[row, a]
            assert torch.equal(mask[row, 0, q, :12], plain[row, 0, q, :12] & same_doc)
            assert torch.equal(mask[row, 0, q, 12:], plain[row, 0, q, 12:])
    # the first anchor of document 1 (position 5) sees no context at all, as an unpacked row's
    # anchor at 0 would; its own block keeps the softmax row non-empty
    assert not mask[0, 0, 8:12, :12].any() and mask.sum(-1).min() > 0


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_packed_document_sees_what_it_sees_alone(spec):
    """Document 1 of row 0 (positions 5..11) packed behind document 0 gives the same mask over
    its own context as the document alone in an unpacked row (positions shifted by 5)."""
    anchors = torch.tensor([[5, 7, 9]])
    starts = document_starts(DOC_IDS[:1])
    packed = BlockLayout(anchors, 12, 4, doc_starts_bn=starts.gather(1, anchors))
    alone = BlockLayout(anchors - 5, 7, 4)
    got, want = dense_mask(packed, spec)[0, 0], dense_mask(alone, spec)[0, 0]
    assert torch.equal(got[:, 5:12], want[:, :7]) and not got[:, :5].any()
    assert torch.equal(got[:, 12:], want[:, 7:])
    assert torch.equal(packed.positions_bq(), alone.positions_bq())


def test_a_packed_context_is_no_inference_layout():
    """flash's window cannot start at a document boundary: such layouts are not for flash."""
    one = BlockLayout(torch.tensor([[9]]), 9, 4, doc_starts_bn=torch.tensor([[0]]))
    assert is_inference_layout(one)
    assert not is_inference_layout(BlockLayout(torch.tensor([[9]]), 9, 4,
                                               doc_starts_bn=torch.tensor([[4]])))
