"""module/optimizer=muon (dflash_lab/train/optim.py): Muon over the drafter's weight matrices,
AdamW over the rest, as one optimizer: the split, a step equal to the two stepped apart, the lr
schedule and the state on both, a clear refusal to resume an AdamW checkpoint, and a tiny
dflash-train run that trains and resumes with it."""

import copy

import pytest
import torch

from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.optim import MuonAdamW, muon_params
from dflash_lab.train.schedule import warmup_cosine
from tests.export_doubles import make_config
from tests.train.test_warm_start import V2


def _drafter(**kw) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(make_config("zlab_default", **kw), backend="sdpa")


def _grads(drafter: DFlashDrafter, seed: int) -> None:
    """Random gradients on every trainable parameter (the optimizers' input)."""
    g = torch.Generator().manual_seed(seed)
    for p in drafter.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    drafter = _drafter(learned_mask_embedding=True, attention_sink_bias=True, **V2)
    muon, rest = muon_params(drafter.named_parameters())
    muon_names, rest_names = {n for n, _ in muon}, {n for n, _ in rest}
    projections = {n for n, p in drafter.named_parameters()
                   if n.startswith("layers.") and p.ndim == 2}
    # the selector's hidden projection is a weight matrix too; its codebooks are lookups
    assert muon_names == projections | {"fc.weight", "candidate_selector.hidden_projection.weight"}
    assert all(p.ndim == 2 and min(p.shape) > 1 for _, p in muon)
    assert any("codebook" in n for n in rest_names)  # 2-D lookups stay on AdamW
    assert "mask_embedding" in rest_names and any("norm" in n for n in rest_names)
    assert any("sink" in n for n in rest_names)


def test_a_step_equals_muon_and_adamw_stepped_apart():
    ours, ref = _drafter(), _drafter()
    _grads(ours, 1)
    _grads(ref, 1)
    MuonAdamW(list(ours.named_parameters()), lr=1e-2, weight_decay=0.01).step()
    muon, rest = muon_params(ref.named_parameters())
    torch.optim.Muon(muon, lr=1e-2, momentum=0.95, weight_decay=0.1, ns_steps=5,
                     adjust_lr_fn="match_rms_adamw").step()
    torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01).step()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(),
                                                      _drafter().parameters(), strict=True))


def test_the_schedule_and_the_state_dict_cover_both_optimizers():
    drafter = _drafter()
    opt = MuonAdamW(list(drafter.named_parameters()), lr=1e-2, muon_lr=2e-2)
    schedule = warmup_cosine(opt, total_steps=20, warmup_ratio=0.5)
    for step in range(3):
        _grads(drafter, step)
        opt.step()
        schedule.step()
    muon_lr, adamw_lr = (g["lr"] for g in (opt.parts[0].param_groups[0],
                                            opt.parts[1].param_groups[0]))
    assert muon_lr == pytest.approx(2 * adamw_lr) and 0 < adamw_lr < 1e-2  # warming up, both
    assert len(opt.state) == sum(1 for p in drafter.parameters() if p.requires_grad)
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it (not shared tensors)
    twin = _drafter()
    twin.load_state_dict(drafter.state_dict())
    again = MuonAdamW(list(twin.named_parameters()), lr=1e-2, muon_lr=2e-2)
    again.load_state_dict(saved)
    _grads(drafter, 9)
    _grads(twin, 9)
    opt.step()
    again.step()
    assert all(torch.equal(a, b) for a, b in zip(drafter.parameters(), twin.parameters(),
                                                  strict=True))


def test_an_adamw_checkpoint_is_refused_naming_the_fix():
    drafter = _drafter()
    adamw = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"module/optimizer=adamw.*ckpt_path=null"):
        MuonAdamW(list(drafter.named_parameters())).load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="needs \\(name, parameter\\) pairs"):
        MuonAdamW(drafter.parameters())


def test_dflash_train_with_muon_trains_and_resumes(tiny_target_dir, tmp_path):
    from dflash_lab.train.run import train
    from tests.train.test_faults import _train_cfg

    run = tmp_path / "run"
    first = train(_train_cfg(tmp_path, tiny_target_dir, run, **{"module/optimizer": "muon"}))
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["optimizer_states"][0]["parts"] == ["Muon", "AdamW"]
    assert first["val_tau_after"] >= 1.0
    resumed = train(_train_cfg(tmp_path, tiny_target_dir, run, **{
        "module/optimizer": "muon", "trainer.max_epochs": 3,
        "resume_allow_changes": "[trainer.max_epochs]"}))
    after = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert after["global_step"] > ckpt["global_step"] and resumed["val_tau_after"] >= 1.0
