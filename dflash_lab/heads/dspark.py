"""DSpark (docs/dspark.md; speculators 0.9.0 ``models/dspark``, vLLM 0.32 ``qwen3_dspark.py``):
the DFlash 1 backbone plus a Markov logit-bias head over the previous token and a confidence
head (model/dspark.py), trained with the Markov-biased CE and the confidence BCE
(train/dspark.py) and drafted with the sequential Markov walk (eval/sampling.py
``markov_draft``). Served as vLLM's ``Qwen3DSparkModel`` in the speculators layout."""

from __future__ import annotations

from typing import Any

from dflash_lab.eval.sampling import markov_draft
from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.model.dspark import MARKOV_HEAD_TYPES, ConfidenceHead, MarkovHead
from dflash_lab.model.heads import register
from dflash_lab.train.dspark import confidence_loss, markov_inputs, markov_prev_ids
from dflash_lab.train.objective import Term

#: Defaults when ``variant=dspark`` leaves them unset: speculators 0.9.0's
#: ``DSparkSpeculatorConfig`` defaults.
DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True}
#: The logit scales every other head honours, at their "off" values.
_SCALES_OFF = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
               "final_logit_softcapping": None}


class DSpark(DFlash1):
    name = "dspark"
    title = "DSpark"
    architecture = "Qwen3DSparkModel"  # vLLM's name (qwen3_dspark.py)
    fields = DEFAULTS
    walk = "Markov walk"
    #: no val/tau_T: the distribution pass reads a plain Linear head, not [W | markov_w2]
    expected_taus = False

    def validate(self, config: Any) -> None:
        rank = config.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            config._fail("markov_rank", rank, "must be an integer >= 0 (0 = no Markov head)")
        if config.markov_head_type not in MARKOV_HEAD_TYPES:
            config._fail("markov_head_type", config.markov_head_type,
                         f"must be one of {list(MARKOV_HEAD_TYPES)}")
        for key in ("enable_confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(config, key), bool):
                config._fail(key, getattr(config, key), "must be true or false")
        if config.enable_confidence_head and config.confidence_head_with_markov and rank == 0:
            config._fail("confidence_head_with_markov", True,
                         "needs markov_rank > 0 (its input is the Markov embedding); set it "
                         "false or give a markov_rank")
        for key, off in _SCALES_OFF.items():
            if getattr(config, key) != off:
                config._fail(key, getattr(config, key), "is not implemented for "
                             "variant='dspark' (vLLM scales the backbone logits and the Markov "
                             f"bias apart); leave it at {off}")

    def attach(self, drafter: Any) -> None:
        """The Markov head (markov_rank > 0) and the confidence head."""
        c = drafter.config
        if c.markov_rank > 0:
            drafter.markov_head = MarkovHead(c.hidden_size, c.vocab_size,
                                             c.draft_vocab_size or c.vocab_size, c.markov_rank,
                                             c.markov_head_type)
        if c.enable_confidence_head:
            drafter.confidence_head = ConfidenceHead(c.hidden_size, c.markov_rank,
                                                     c.confidence_head_with_markov)

    def check_training(self, config: Any, module: Any) -> None:
        """DSpark trains on the CE pass only (the distribution pass computes its gradient to
        the hidden states alone, so markov_w2 would not learn)."""
        super().check_training(config, module)
        if config.markov_rank and not module.loss_spec.ce_only:
            raise ValueError("module.loss: a DSpark drafter with a Markov head trains with "
                             "module.loss=ce only (the distribution losses' fused pass does not "
                             "train markov_w2); set module.loss=ce")

    def head_inputs(self, module: Any, step: Any) -> None:
        """The Markov bias joins the head: ``[h; f] @ [W_lm | markov_w2]``."""
        cfg = module.drafter.config
        prev = markov_prev_ids(step.batch["input_ids"], step.token_ids, step.anchors,
                               cfg.block_size, cfg.label_shift)
        step.head_in, step.lm_head, step.emb = markov_inputs(module.drafter, step.hidden, prev,
                                                             step.lm_head)

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        out.head_pieces["confidence"] = confidence_loss(module.drafter, step.hidden, step.emb, out,
                                         module.hparams.gamma)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """The confidence BCE per supervised slot (speculators' mean), where a head is."""
        conf = out.head_pieces.get("confidence")
        if conf is None:
            return []
        return [Term("confidence", conf.weighted_sum, conf.count,
                     module.hparams.confidence_head_alpha, "confidence_loss",
                     extra=(("confidence_abs_error",
                             conf.abs_error_sum / conf.count.clamp(min=1)),))]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any) -> tuple[Any, Any] | None:
        if drafter.markov_head is None:  # markov_rank 0: the backbone's draft
            return None
        return markov_draft(drafter, hidden_kh, unary_kv, anchor_id, temperature, mode,
                            generator)


HEAD = register(DSpark())
