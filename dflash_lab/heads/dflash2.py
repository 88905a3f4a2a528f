"""DFlash 2 (dflash.md section 7): DFlash 1 plus a grouped dynamic causal conv around every
sublayer of every draft layer (model/dflash2.py ``GroupedDynamicCausalConv``) and a candidate
selector that re-ranks the unary top-K of every slot (``CandidateSelector``), trained with the
selector CE beside the unary loss (train/selector.py) and walked left to right when drafting
(eval/sampling.py ``selector_draft``). Served as z-lab's ``DFlash2DraftModel``."""

from __future__ import annotations

from typing import Any

from dflash_lab.eval.sampling import selector_draft
from dflash_lab.model.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_lab.model.heads import Head, register
from dflash_lab.train.objective import Term
from dflash_lab.train.selector import selector_loss

#: Defaults when ``variant=dflash2`` leaves them unset: the released Qwen3.8-27B-DFlash2 setting.
DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
            "selector_top_k": 16}


class DFlash2(Head):
    name = "dflash2"
    title = "DFlash 2"
    architecture = "DFlash2DraftModel"
    fields = DEFAULTS
    walk = "selector"
    tensors = "conv and selector tensors"
    weight_fields = ("conv_kernel_size", "conv_group_size", "selector_rank")

    def validate(self, config: Any) -> None:
        for key in DEFAULTS:
            if int(getattr(config, key)) < 1:
                config._fail(key, getattr(config, key), "must be a positive integer")
        if config.hidden_size % config.conv_group_size:
            config._fail("conv_group_size", config.conv_group_size,
                         f"must divide hidden_size={config.hidden_size} (channels per dynamic "
                         "tap)")
        if config.conv_kernel_size > config.block_size:
            config._fail("conv_kernel_size", config.conv_kernel_size,
                         f"must be <= block_size={config.block_size}: taps never cross a block "
                         "start, so longer kernels have taps that never see a token")
        if config.selector_top_k > config.vocab_size:
            config._fail("selector_top_k", config.selector_top_k,
                         f"must be <= vocab_size={config.vocab_size} (candidates come from the "
                         "full target vocabulary)")
        if config.sample_from_anchor:
            config._fail("sample_from_anchor", True,
                         "is not implemented for variant='dflash2' (the selector's predecessor "
                         "tokens assume an anchor slot that predicts nothing); use "
                         "variant='dflash1' or sample_from_anchor=false")
        if config.draft_vocab_size is not None and config.draft_vocab_size < config.vocab_size:
            config._fail("draft_vocab_size", config.draft_vocab_size,
                         "DFlash 2's candidate selector scores candidates over the target's "
                         "whole vocabulary (its codebooks are vocabulary-sized): set "
                         "drafter.draft_vocab_size=null, or train a DFlash 1 drafter "
                         "(variant=dflash1) for a reduced draft vocabulary")

    def check_read(self, fields: dict[str, Any], source: str) -> None:
        """z-lab's loader needs the conv and the selector named."""
        missing = [f"dflash_config.{k}" for k in DEFAULTS if k not in fields]
        if missing:
            raise ValueError(f"{source}: a DFlash2DraftModel config needs {missing}")

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        drafter.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size,
                                                       c.selector_rank, c.selector_top_k)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Per layer two convs (base [2, K, H], projection [2*K*G, H], G = H / conv_group_size
        groups), and the selector (codebooks [V, R], projection [R, H])."""
        h, k, r = config.hidden_size, config.conv_kernel_size, config.selector_rank
        groups = h // config.conv_group_size
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(config.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, h)
        for side in ("predecessor", "successor"):
            shapes[f"candidate_selector.{side}_codebook"] = (config.vocab_size, r)
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
        return shapes

    def layer_modules(self, config: Any) -> dict[str, Any]:
        def conv() -> GroupedDynamicCausalConv:
            return GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                            config.conv_group_size, config.block_size)
        return {"attention_conv": conv(), "mlp_conv": conv()}

    def min_slots(self, config: Any) -> int:
        """K - 1 for a conv of K taps (its shifted taps need offset <= slots)."""
        return max(2, config.conv_kernel_size - 1)

    def unary_top_k(self, config: Any) -> int:
        return config.selector_top_k

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """The selector CE over the unary top-K (``out.selector``)."""
        hp = module.hparams
        out.selector = selector_loss(
            module.drafter.candidate_selector, step.hidden, out, step.tgt,
            step.batch["input_ids"].gather(1, step.anchors), step.lm_head, hp.gamma,
            module.selector_settings.missing_gold, module.logit_scale, hp.ce_chunk_bytes,
            **step.weighting, teacher=step.teacher if step.selector_soft else None,
            label_temperature=module.loss_spec.label_temperature,
            temperatures=step.temperatures, eval_teacher=step.teacher)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """The selector CE at ``alpha(step)``, even at alpha 0 (every parameter stays in the
        graph under DDP)."""
        alpha = module.selector_settings.alpha_at(step)
        sel = out.selector
        return [Term("selector", sel.weighted_sum, sel.weight_sum, alpha, "selector_loss",
                     extra=(("alpha", float(alpha)),))]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any) -> tuple[Any, Any]:
        return selector_draft(drafter.candidate_selector, hidden_kh, unary_kv, anchor_id,
                              temperature, mode, generator)


HEAD = register(DFlash2())
