"""Dtype policy: target dtype x trainer precision all train, validate, export and evaluate.

The target keeps its own dtype (its frozen pieces are shared, never copied); the drafter computes
in the trainer's precision. Activations cross each boundary with one cast: target features and
embedding rows into the drafter (``DFlashDrafter.fuse`` / ``block_inputs``), the drafter's
hidden states into the target head (``chunked_head_pass``).
"""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.plugins.precision import MixedPrecision

from dflash_lab.paths import CONF_DIR
from dflash_lab.train.loss import chunked_head_pass


def test_head_ce_accepts_hidden_states_in_another_dtype():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(6, 16, requires_grad=True)
    labels = torch.randint(40, (6,))
    ce = chunked_head_pass(hidden, labels, head).ce
    ce.sum().backward()
    assert ce.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    want = torch.nn.functional.cross_entropy(
        head(hidden.detach().to(torch.bfloat16)).float(), labels, reduction="none")
    torch.testing.assert_close(ce.detach(), want)


class _Trainer:
    """What clipping reads of a trainer."""

    def __init__(self, plugin):
        self.precision_plugin = plugin
        self.gradient_clip_val = 1.0
        self.gradient_clip_algorithm = "norm"


def _module_with_big_grads(plugin):
    from functools import partial

    from dflash_lab.targets.target import TargetPieces
    from dflash_lab.train.factory import build_drafter
    from dflash_lab.train.module import DFlashModule
    from tests.stand_ins import config_target

    shape = {"hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32}
    drafter = build_drafter(config_target(shape), num_hidden_layers=1, block_size=4,
                            target_layer_ids=[1], mask_token_id=31)
    head = TargetPieces(torch.nn.Embedding(32, 8), torch.nn.Identity(),
                        torch.nn.Linear(8, 32, bias=False))
    module = DFlashModule(drafter, head, partial(torch.optim.AdamW, fused=True))
    for p in module.drafter.parameters():
        p.grad = torch.full_like(p, 10.0)
    module._trainer = _Trainer(plugin)
    return module, module.configure_optimizers()


def test_fused_adamw_clips_under_bf16_mixed():
    module, opt = _module_with_big_grads(MixedPrecision("bf16-mixed", "cpu"))
    module.configure_gradient_clipping(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    norm = torch.cat([p.grad.flatten() for p in module.drafter.parameters()]).norm()
    assert norm == pytest.approx(1.0, rel=1e-4)


def test_fp16_with_a_grad_scaler_keeps_lightnings_refusal():
    scaler = torch.amp.GradScaler("cpu")
    module, opt = _module_with_big_grads(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        module.configure_gradient_clipping(opt, gradient_clip_val=1.0,
                                           gradient_clip_algorithm="norm")


def _train_cfg(tmp_path, target_dir, dtype, precision):
    overrides = [
        "recipe=tiny_cpu", "target=hf", f"target.name_or_path={target_dir}",
        "target.device=cpu", f"trainer.precision={precision}", "trainer.max_steps=2",
        "trainer.max_epochs=1", f"paths.output_dir={tmp_path / 'run'}", "logger=none",
        "data.demo_rows=40", f"data.demo_file={tmp_path / 'demo.jsonl'}", "data.max_length=96",
        "data.batch_size=8", "data.val_fraction=0.25", "export.dtype=bfloat16"]
    if dtype is not None:  # None: target=hf's own default (bfloat16), as a user gets it
        overrides.append(f"target.dtype={dtype}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "float32"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_dtype_and_precision_trains_exports_and_evaluates(dtype, precision, tmp_path,
                                                              tiny_target_dir):
    from dflash_lab.eval.evaluate import evaluate_prompts
    from dflash_lab.eval.loading import load_drafter
    from dflash_lab.eval.loop import DecodeSettings
    from dflash_lab.eval.proposer import DFlashProposer
    from dflash_lab.targets.loader import load_target
    from dflash_lab.train.run import train

    cfg = _train_cfg(tmp_path, tiny_target_dir, dtype, precision)
    assert cfg.target.dtype == (dtype or "bfloat16")
    result = train(cfg)
    assert result["val_tau_after"] >= 1.0 and "export_dir" in result
    target = load_target(str(tiny_target_dir), dtype=cfg.target.dtype, device="cpu")
    loaded = load_drafter(result["export_dir"], dtype=target.model.dtype)
    pieces = target.pieces()
    proposer = DFlashProposer(loaded.drafter, pieces.embed_tokens, pieces.lm_head)
    prompts = [target.tokenizer("<|im_start|>user\nadd 3 and 4<|im_end|>\n")["input_ids"]] * 2
    spec, base = evaluate_prompts(target.model, proposer, loaded.drafter.config.target_layer_ids,
                                  prompts, DecodeSettings(max_new_tokens=12), progress=False)
    assert all(len(g.output_ids) > 0 and g.acceptance_lengths for g in spec)
    if cfg.target.dtype == "float32":  # fp32 greedy is exactly lossless; bf16 may drift
        assert [g.output_ids for g in spec] == [g.output_ids for g in base]


def test_a_schedule_without_a_horizon_is_refused_naming_the_fix():
    """max_epochs=-1 and no max_steps: Lightning's estimate is inf; the warmup-cosine schedule
    needs a step count, so the module says which setting to give (not int(inf)'s OverflowError)."""
    from functools import partial

    from dflash_lab.train.schedule import warmup_cosine

    module, _ = _module_with_big_grads(None)
    module.scheduler_factory = partial(warmup_cosine, warmup_ratio=0.04, min_lr_ratio=0.0)
    module._trainer.estimated_stepping_batches = float("inf")
    with pytest.raises(ValueError, match=r"module.scheduler needs a finite number of steps.*"
                                         r"trainer.max_steps=N or trainer.max_epochs=N"):
        module.configure_optimizers()
    module._trainer.estimated_stepping_batches = 40
    assert module.configure_optimizers()["lr_scheduler"]["interval"] == "step"
