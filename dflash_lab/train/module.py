"""DFlashModule: the LightningModule that trains a drafter against frozen target pieces. One
training step (:meth:`DFlashModule.step`) is four named calls, ``target_features`` ->
``sample_anchors`` -> ``draft`` -> ``loss`` (docs/architecture.md, "One training step"); then
``objective`` sums the named terms of the loss pieces (train/objective.py), each normalised by
its GLOBAL count across devices, and one loop logs them (:meth:`DFlashModule._log_terms`). The
batch contract: docs/data.md; packed rows train each document exactly as unpacked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn

from dflash_lab.model.drafter import DFlashDrafter
from dflash_lab.train.anchors import sample_anchors, step_generator
from dflash_lab.train.distill import (
    LossSpec,
    resolve_val_temperatures,
    slot_teacher,
    teacher_kind,
)
from dflash_lab.train.loss import (
    CE_CHUNK_BYTES,
    LABEL_SOURCES,
    LogitScale,
    LossOutput,
    acceptance_lengths,
    block_targets,
    ce_chunk_rows,
    check_position_weighting,
    per_position_accuracy,
    position_weights,
    token_targets,
)
from dflash_lab.train.objective import (
    StepParts,
    Term,
    dflash_loss,
    local_means,
    objective,
    terms,
)

#: Prefix of the frozen target pieces: never written to checkpoints.
TARGET_PREFIX = "target_head."


class DFlashModule(L.LightningModule):
    """Owns loss, metrics and optimisation of one drafter. target_head: frozen ``embed_tokens``
    and ``lm_head`` (never trained, never saved). optimizer / scheduler: Hydra partials
    (``params -> Optimizer``, ``optimizer -> LRScheduler``, stepped every step). ce_chunk_size /
    ce_chunk_bytes: ``loss.ce_chunk_rows``. selector / head: ``module.selector`` and
    ``module.head``, validated by the head (``check_training``, ``Head.settings``).
    feature_source: ``input_ids [Bt, S] -> TargetFeatures`` for batches without ``hidden`` (the
    online target; None for captures)."""

    def __init__(self, drafter: DFlashDrafter, target_head: nn.Module,
                 optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, *, gamma: float = 7.0,
                 num_anchors: int = 512, label_source: str = "target_argmax",
                 ce_chunk_size: int | None = None, ce_chunk_bytes: int = CE_CHUNK_BYTES,
                 seed: int = 0, val_seed: int = 1234,
                 compile: bool = False, activation_checkpointing: bool = False,
                 selector: Mapping[str, Any] | None = None,
                 position_weighting: str = "exp_decay", dpace_alpha: float = 0.5,
                 loss: str | Mapping[str, float] = "ce", label_temperature: float = 1.0,
                 lk_eta: float = 3.0, accept_temperature: float = 1.0,
                 val_temperatures: Sequence[float] | None = None,
                 feature_source: Callable[[Tensor], Any] | None = None,
                 target_distribution: Mapping[str, Any] | None = None,
                 confidence_head_alpha: float = 1.0, head: Mapping[str, Any] | None = None):
        super().__init__()
        if label_source not in LABEL_SOURCES:
            raise ValueError(f"module.label_source='{label_source}': use one of "
                             f"{list(LABEL_SOURCES)}")
        selector = dict(selector or {})  # plain types in the checkpoint's hyper_parameters
        self.selector = selector  # the head reads it (check_training)
        position_weights(drafter.config.block_size, gamma)  # validates gamma early
        check_position_weighting(position_weighting, dpace_alpha)
        ce_chunk_rows(drafter.config.vocab_size, ce_chunk_size, ce_chunk_bytes)  # and these
        loss = loss if isinstance(loss, str) else {str(k): float(v) for k, v in loss.items()}
        self.loss_spec = LossSpec.create(loss, label_temperature, lk_eta, accept_temperature)
        if not float(confidence_head_alpha) >= 0:
            raise ValueError(f"module.confidence_head_alpha={confidence_head_alpha}: must be "
                             ">= 0 (speculators: 1.0)")
        head = dict(head or {})  # plain types in the checkpoint's hyper_parameters
        self.head_settings = drafter.config.head.settings(head)  # module.head
        drafter.config.head.check_training(drafter.config, self)  # before a teacher is chosen
        self.val_temperatures = resolve_val_temperatures(val_temperatures, target_distribution)
        self.teacher_kind = teacher_kind(self.loss_spec, target_distribution,
                                         self.val_temperatures, "the training data",
                                         drafter.config.head.needs_distribution(self))
        for feature in drafter.config.features:
            feature.check_training(drafter.config, self)
        self.teacher_softcap = getattr(target_head, "logit_softcap", None)
        self.save_hyperparameters(ignore=["drafter", "target_head", "optimizer", "scheduler",
                                          "feature_source", "target_distribution"])
        self.feature_source = feature_source
        self.drafter = drafter
        self.target_head = target_head.requires_grad_(False)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.strict_loading = False  # target_head is not in checkpoints
        drafter.init_mask_embedding(self.target_head.embed_tokens)
        drafter.activation_checkpointing = activation_checkpointing
        self._val_taus: list[Tensor] = []
        self._val_loss: list[Tensor] = []
        self._val_expected: dict[str, list[Tensor]] = {}
        self._walk = drafter.config.head.walk_metrics()  # None: the CE pass's tau is served
        #: submodules whose dense CPU gradients are zeroed in place (optimizer_zero_grad)
        self._grad_keepers = [m for m in drafter.modules() if hasattr(m, "zero_grads_in_place_")]
        self.logit_scale = LogitScale.of(drafter.config)
        if compile:
            self.drafter.compile_layers()

    # ------------------------------------------------------------------ the step
    def step(self, batch: dict[str, Tensor], generator: torch.Generator) -> LossOutput:
        """One step's loss pieces, in order: target features -> anchors -> drafter -> loss."""
        batch = self.target_features(batch)
        anchors, anchor_valid = self.sample_anchors(batch, generator)
        hidden = self.draft(batch, anchors)
        return self.loss(batch, hidden, anchors, anchor_valid)

    def target_features(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The batch with ``hidden`` [Bt, S, F] and ``target_argmax`` [Bt, S]: as captured, or
        from ``feature_source`` (the frozen target, no grad) when the batch has ids only."""
        if "hidden" in batch:
            return batch
        if self.feature_source is None:
            raise ValueError("this batch has no 'hidden' target features and the module has no "
                             "feature_source: use a capture (data=offline) or online data, "
                             "whose data module gives the target as feature_source")
        docs = batch.get("document_ids")
        feats = (self.feature_source(batch["input_ids"]) if docs is None
                 else self.feature_source(batch["input_ids"], document_ids_bs=docs))
        return {**batch, "hidden": feats.hidden_bsf, "target_argmax": feats.argmax_bs,
                "target_last_hidden": feats.last_bsh}

    def sample_anchors(self, batch: dict[str, Tensor], generator: torch.Generator):
        """Sorted anchors [Bt, N] and their validity for this batch."""
        return sample_anchors(batch["loss_mask"], self.hparams.num_anchors, generator,
                              batch.get("document_ids"))

    def draft(self, batch: dict[str, Tensor], anchors: Tensor) -> Tensor:
        """The drafter's hidden states [Bt, N, B, H] for the blocks anchored at ``anchors``."""
        return self.drafter(batch["hidden"], batch["input_ids"], anchors,
                            self.target_head.embed_tokens, batch.get("document_ids"))

    def loss(self, batch: dict[str, Tensor], hidden: Tensor, anchors: Tensor,
             anchor_valid: Tensor) -> LossOutput:
        """The (local) weighted loss pieces of the drafted blocks ``hidden`` [Bt, N, B, H]:
        labels at the anchored slots, the CE pass, and the head's terms (``add_terms``)."""
        hp, cfg = self.hparams, self.drafter.config
        head = cfg.head
        lm_head = self.drafter.head(self.target_head.lm_head)
        token_ids = token_targets(batch["input_ids"], batch.get("target_argmax"),
                                  hp.label_source)
        # a draft vocabulary: labels as draft ids; a token outside it (-1) is no valid slot:
        # no loss (nothing can raise it) and, in the greedy tau, a miss (it is never drafted)
        targets = self.drafter.to_draft_ids(token_ids)
        tgt = block_targets(targets, batch["loss_mask"], anchors, anchor_valid, cfg.block_size,
                            batch.get("document_ids"), cfg.label_shift)
        weighting = {"weighting": hp.position_weighting, "dpace_alpha": hp.dpace_alpha}
        temperatures = () if self.training or not head.expected_taus \
            else tuple(self.val_temperatures)
        kind = self.teacher_kind if (self.loss_spec.needs_distribution or temperatures
                                     or head.needs_distribution(self)) else "none"
        teacher = slot_teacher(kind, batch, anchors, tgt.valid, self.teacher_softcap,
                               cfg.label_shift)
        step = StepParts(batch, hidden, anchors, token_ids, tgt, lm_head, teacher, temperatures,
                         weighting, head_in=hidden)
        head.head_inputs(self, step)
        out = dflash_loss(step.head_in, tgt, step.lm_head, hp.gamma, hp.ce_chunk_size,
                          anchor_valid, hp.ce_chunk_bytes, scale=self.logit_scale,
                          top_k=head.unary_top_k(cfg), **weighting, spec=self.loss_spec,
                          teacher=teacher, temperatures=temperatures)
        head.add_losses(self, step, out)
        return out

    def blocks_loss(self, batch: dict[str, Tensor], anchors: Tensor,
                    anchor_valid: Tensor) -> LossOutput:
        """Steps 3-4 for given anchors (tests and benchmarks fix the anchors)."""
        return self.loss(batch, self.draft(batch, anchors), anchors, anchor_valid)

    def terms(self, out: LossOutput, step: int) -> list[Term]:
        """The named terms of the objective at optimizer step ``step`` (train/objective.py)."""
        return (terms(out, self.loss_spec.accept_weight)
                + self.drafter.config.head.terms(self, out, step))

    def objective(self, out: LossOutput, step: int, world_size: int = 1,
                  all_reduce_sum=None) -> Tensor:
        """The loss to backpropagate: the sum of :meth:`terms`, each normalised by its GLOBAL
        count (a DFlash 2 drafter's selector term at ``alpha(step)``, also at alpha 0)."""
        return objective(self.terms(out, step), world_size, all_reduce_sum)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.step(batch, step_generator(self.hparams.seed, self.global_step,
                                              self.global_rank))
        found = self.terms(out, self.global_step)
        loss = objective(found, self.trainer.world_size, lambda t: self.all_gather(t).sum())
        self._log_terms(out, found, "train", batch["input_ids"].shape[0])
        return loss

    def _log_terms(self, out: LossOutput, found: list[Term], stage: str, bs: int) -> None:
        """One loop over the terms: each term's metric, the parts of a mixed label loss
        (``{stage}/loss_{name}``), the objective as ``{stage}/loss`` and the greedy tau. With a
        walk of its own (``walk_metrics``, DFlash 2) tau is the walk's; the objective without
        the head's last term and the unary tau are logged as ``unary_loss`` and ``unary_tau``."""
        norm = out.weight_sum.clamp(min=1e-8)
        if not self.loss_spec.ce_only:
            for name, total in (out.term_sums or {}).items():
                self.log(f"{stage}/loss_{name}", total / norm, batch_size=bs)
        logs = {}
        for term in found[1:]:
            logs[f"{stage}/{term.metric}"] = term.shown * term.local_mean()
            logs.update((f"{stage}/{key}", value) for key, value in term.extra)
        taus = acceptance_lengths(out.correct, out.block_valid, out.first_slot)
        if self._walk is not None:
            logs[f"{stage}/unary_loss"] = local_means(found[:-1])
            logs[f"{stage}/unary_tau"] = taus.mean() if taus.numel() else 1.0
            taus = acceptance_lengths(self._walk.correct(out), out.block_valid)
        self.log_dict(logs, batch_size=bs)
        self.log(f"{stage}/loss", local_means(found), prog_bar=True, batch_size=bs)
        self.log(f"{stage}/tau", taus.mean() if taus.numel() else 1.0, prog_bar=True,
                 batch_size=bs)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.step(batch, step_generator(self.hparams.val_seed, batch_idx,
                                              self.global_rank))
        self._val_taus.append(acceptance_lengths(out.correct, out.block_valid,
                                                 out.first_slot).cpu())
        for t, taus in (out.expected_taus or {}).items():  # a walk's head: the unary path's
            key = f"val/unary_tau_T{t:g}" if self._walk is not None else f"val/tau_T{t:g}"
            self._val_expected.setdefault(key, []).append(taus.cpu())
        self._val_loss.append(torch.stack([out.weighted_sum, out.weight_sum]).detach().cpu())
        if self._walk is not None:
            self._walk.update(out)
        for t, acc in enumerate(per_position_accuracy(out), start=1):
            if acc == acc:  # skip NaN (slot never valid in this batch)
                self.log(f"val/acc_pos{t}", acc, batch_size=batch["input_ids"].shape[0],
                         sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        taus = torch.cat(self._val_taus) if self._val_taus else torch.ones(1)
        sums = torch.stack(self._val_loss).sum(0) if self._val_loss else torch.tensor([0.0, 1.0])
        self._val_taus.clear()
        self._val_loss.clear()
        for key, parts in sorted(self._val_expected.items()):
            expected = torch.cat(parts)
            self.log(key, expected.mean() if expected.numel() else 1.0, sync_dist=True)
        self._val_expected.clear()
        self.log("val/loss", sums[0] / sums[1].clamp(min=1e-8), sync_dist=True)
        if self._walk is None:
            self.log("val/tau", taus.mean(), prog_bar=True, sync_dist=True)
            return
        # a walk of its own: val/tau is its path's (the checkpoint monitor picks by it)
        metrics = self._walk.compute()
        self._walk.reset()
        self.log("val/tau", metrics.pop("val/tau"), prog_bar=True, sync_dist=True)
        self.log_dict(metrics, sync_dist=True)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        """``module.optimizer`` over the drafter's trainable ``(name, parameter)`` pairs (every
        torch optimizer takes them; Muon's split reads the names: dflash_lab/train/optim.py)."""
        params = [(n, p) for n, p in self.drafter.named_parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        total = self.trainer.estimated_stepping_batches if self._trainer else 1
        if not math.isfinite(total):
            raise ValueError("module.scheduler needs a finite number of steps, and the trainer "
                             "has none (trainer.max_epochs=-1 without trainer.max_steps): set "
                             "trainer.max_steps=N or trainer.max_epochs=N, or module.scheduler="
                             "null for a constant learning rate")
        scheduler = self.scheduler_factory(optimizer, total_steps=max(1, int(total)))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_zero_grad(self, epoch: int, batch_idx: int,
                            optimizer: torch.optim.Optimizer) -> None:
        """Lightning's ``optimizer.zero_grad()`` (gradients set to None), except the dense CPU
        gradients a head's module zeroes in place (``zero_grads_in_place_()`` returns those
        parameters; DFlash 2's codebooks): their next backward adds the few looked-up rows into
        them instead of mapping and page-faulting a fresh [V, R] buffer every step (the same
        gradient, bitwise, and AdamW still steps every parameter)."""
        kept = [(p, p.grad) for m in self._grad_keepers for p in m.zero_grads_in_place_()]
        optimizer.zero_grad(set_to_none=True)
        for param, grad in kept:
            param.grad = grad

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip as configured, also with the fused AdamW under ``bf16-mixed``: Lightning refuses
        to clip for an optimizer that unscales in its own step (fused AdamW) under mixed
        precision, since a GradScaler (fp16) leaves gradients scaled at clipping time; bf16-mixed
        has no scaler, so clipping before the step is exact. fp16 keeps Lightning's refusal."""
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and getattr(plugin, "scaler", "absent") is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen target pieces; record the drafter's serving config for the exporter."""
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(TARGET_PREFIX)]:
            del state[key]
        checkpoint.setdefault("hyper_parameters", {})
        checkpoint["hyper_parameters"]["drafter_config"] = self.drafter.config.to_dict()

