"""sample_from_anchor: slot k predicts the token at a + k + 1 (labels, validity, weights,
teacher, acceptance), against hand-computed cases; the default alignment is unchanged."""

import math

import pytest
import torch

from dflash_lab.train.distill import expected_accepted, slot_teacher
from dflash_lab.train.loss import (
    acceptance_lengths,
    block_targets,
    dpace_weights,
    position_weights,
    slot_positions,
    slot_weights,
    token_targets,
)
from tests.doubles import tiny_drafter_config

ONE = torch.tensor([[True]])


def test_the_config_names_the_shift_and_the_first_drafting_slot():
    dflash, anchor = tiny_drafter_config(), tiny_drafter_config(sample_from_anchor=True)
    assert (dflash.label_shift, dflash.first_draft_slot, dflash.num_draft_tokens) == (0, 1, 3)
    assert (anchor.label_shift, anchor.first_draft_slot, anchor.num_draft_tokens) == (1, 0, 4)
    assert slot_positions(torch.tensor([[2]]), 3, 1).tolist() == [[[3, 4, 5]]]
    assert slot_positions(torch.tensor([[2]]), 3).tolist() == [[[2, 3, 4]]]


def test_slot_k_predicts_the_token_after_the_anchor_plus_k():
    argmax = torch.tensor([[21, 22, 23, 24, 25, 26]])  # argmax[p]: the target's token for p + 1
    tgt = token_targets(torch.zeros(1, 6, dtype=torch.long), argmax, "target_argmax")
    bt = block_targets(tgt, torch.ones(1, 6), torch.tensor([[2]]), ONE, 3, label_shift=1)
    # slot 0 predicts position 3 (the target's argmax at 2), slot 2 position 5
    assert bt.labels.tolist() == [[[23, 24, 25]]] and bt.valid.tolist() == [[[True] * 3]]
    assert bt.first_slot == 0
    default = block_targets(tgt, torch.ones(1, 6), torch.tensor([[2]]), ONE, 3)
    assert default.labels.tolist() == [[[22, 23, 24]]] and default.first_slot == 1
    assert default.valid.tolist() == [[[False, True, True]]]


def test_validity_follows_the_predicted_position_row_end_mask_and_document():
    tgt = torch.arange(6)[None]
    end = block_targets(tgt, torch.ones(1, 6), torch.tensor([[3]]), ONE, 3, label_shift=1)
    assert end.valid.tolist() == [[[True, True, False]]]  # position 6 is past the row
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
    masked = block_targets(tgt, mask, torch.tensor([[1]]), ONE, 3, label_shift=1)
    assert masked.valid.tolist() == [[[True, False, True]]]  # positions 2, 3 (unmasked), 4
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    packed = block_targets(tgt, torch.ones(1, 6), torch.tensor([[1]]), ONE, 3, docs, 1)
    assert packed.valid.tolist() == [[[True, False, False]]]  # 3 and 4 are the next document
    padding = block_targets(tgt, torch.ones(1, 6), torch.tensor([[1]]), torch.tensor([[False]]),
                            3, label_shift=1)
    assert not padding.valid.any()


def test_exp_decay_weights_start_at_slot_0_with_weight_one():
    gamma = 4.0
    w = position_weights(4, gamma, first_slot=0)
    # speculators 0.9.0 losses/utils.py dflash_loss_decay: exp(-k/gamma) when sample_from_anchor
    assert w.tolist() == pytest.approx([math.exp(-k / gamma) for k in range(4)])
    assert position_weights(4, gamma).tolist() == pytest.approx(
        [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, 4)])
    valid = torch.tensor([[[True, True, False, True]]])
    got = slot_weights(valid, torch.zeros(3), gamma, first_slot=0)
    assert got.tolist() == pytest.approx([1.0, math.exp(-1 / gamma), math.exp(-3 / gamma)])


def test_dpace_counts_slot_0_when_it_is_valid():
    valid = torch.tensor([[[True, True, True]]])
    ce = torch.zeros(1, 1, 3)  # q = 1 everywhere: w_t = number of valid slots at or after t
    assert dpace_weights(ce, valid, 0.5).tolist() == [[[3.0, 2.0, 1.0]]]
    m = slot_weights(valid, torch.zeros(3), 4.0, "dpace", 0.5, first_slot=0)
    assert m.tolist() == [3.0, 2.0, 1.0]


def test_acceptance_counts_from_slot_0():
    correct = torch.tensor([[[True, True, False, True], [False, True, True, True]]])
    blocks = torch.tensor([[True, True]])
    # decoding: tau = 1 + leading accepted drafts; the drafts are slots 0.. (anchor mode)
    assert acceptance_lengths(correct, blocks, first_slot=0).tolist() == [3.0, 1.0]
    assert acceptance_lengths(correct, blocks).tolist() == [2.0, 4.0]  # DFlash: slots 1..
    alpha = correct.float()
    assert (1 + expected_accepted(alpha, correct | True, blocks, 0)).tolist() == [3.0, 1.0]


def test_the_teacher_of_slot_k_is_the_target_output_at_anchor_plus_k():
    s = 8
    batch = {"target_top_ids": torch.arange(s)[None, :, None],  # position p records id p
             "target_top_logprobs": torch.zeros(1, s, 1)}
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    anchored = slot_teacher("sparse", batch, torch.tensor([[2]]), valid, None, label_shift=1)
    assert anchored.top_ids_mk[:, 0].tolist() == [2, 3, 4]
    default = slot_teacher("sparse", batch, torch.tensor([[2]]), valid, None)
    assert default.top_ids_mk[:, 0].tolist() == [1, 2, 3]


def test_the_field_round_trips_and_dflash2_is_refused():
    from dflash_lab.model.config import DrafterConfig

    cfg = tiny_drafter_config(sample_from_anchor=True)
    d = cfg.to_dict()
    assert d["dflash_config"]["sample_from_anchor"] is True
    assert DrafterConfig.from_dict(d).sample_from_anchor is True
    assert tiny_drafter_config().to_dict()["dflash_config"]["sample_from_anchor"] is False
    with pytest.raises(ValueError, match="sample_from_anchor.*dflash2"):
        tiny_drafter_config(sample_from_anchor=True, variant="dflash2")
    with pytest.raises(ValueError, match="must be true or false"):
        tiny_drafter_config(sample_from_anchor="yes")


_DECAY = """
import json, sys, torch
from speculators.losses.utils import dflash_loss_decay
pos = torch.arange(int(sys.argv[1]))
print(json.dumps({str(flag): dflash_loss_decay(pos, float(sys.argv[2]), flag).tolist()
                  for flag in (False, True)}))
"""


def test_position_weights_equal_speculators_own_decay():
    """Both alignments against speculators 0.9.0's ``dflash_loss_decay`` run in its venv."""
    import json
    import subprocess
    from pathlib import Path

    python = Path(__file__).resolve().parents[2] / ".venv-speculators" / "bin" / "python"
    if not python.exists():
        pytest.skip("needs .venv-speculators (make speculators-venv): speculators 0.9.0")
    out = json.loads(subprocess.run([str(python), "-c", _DECAY, "6", "4.0"], check=True,
                                    capture_output=True, text=True).stdout)
    assert position_weights(6, 4.0).tolist() == pytest.approx(out["False"])
    assert position_weights(6, 4.0, first_slot=0).tolist() == pytest.approx(out["True"])
