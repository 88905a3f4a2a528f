"""Domino (docs/design/new_heads.md, "Domino"): the DFlash 1 backbone plus a GRU over the block's
previous tokens whose state corrects the base logits of every slot from the second drafted one.
Served by SGLang 0.5.23 only (``dflash_config.projector_type: "domino"``); the modules, the
greedy draft (:func:`domino_walk`, a point mass at T > 0) and SpecForge's training objective
(:func:`lambda_base`; the correction as one linear head over [z; c], DSpark's
:class:`ConcatHead`): docs/domino.md.

Shape legend: Bt batch, N blocks, B block size, k drafted slots, H hidden, G GRU hidden, E
emb_dim, V vocab, P candidate pool.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.heads.dspark import ConcatHead, markov_prev_ids
from dflash_lab.model.config import SCALE_DEFAULTS
from dflash_lab.model.heads import register
from dflash_lab.train.objective import Term, dflash_loss

#: Fields and defaults: SGLang's keys; G and E as the later speculators' defaults.
DEFAULTS = {"projector_type": "domino", "shift_label": False, "pure_draft_prefix_len": 1,
            "gru_hidden_dim": 1024, "emb_dim": 256}
#: ``module.head`` settings: SpecForge's ``linear_lambda_base`` defaults.
SETTINGS = {"lambda_start": 1.0, "decay_ratio": 0.5}


def lambda_base(step: int, total_steps: int | None, lambda_start: float = 1.0,
                decay_ratio: float = 0.5) -> float:
    """SpecForge's base-loss weight: linear from ``lambda_start`` to 0 over the first
    ``total_steps * decay_ratio`` steps, then 0, clamped to [0, 1]; 0 without a horizon."""
    if not total_steps or total_steps <= 0 or math.isinf(total_steps):  # inf: max_epochs=-1
        return 0.0
    progress = min(step / max(1, int(total_steps * decay_ratio)), 1.0)
    return max(0.0, min(1.0, lambda_start * (1.0 - progress)))


def refuse_unserved(config: Any, positive: tuple[str, ...], engine: str) -> None:
    """Refuse ``positive`` fields that are no integer >= 1, and what ``engine``'s walk of the
    head does not compute: sample_from_anchor, a draft vocabulary, logit scales."""
    title = config.head.title
    for key in positive:
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            config._fail(key, value, "must be an integer >= 1")
    if config.sample_from_anchor:
        config._fail("sample_from_anchor", True, f"must be false for {title} (the fill-in "
                     "layout: slot 0 is the anchor)")
    if config.draft_vocab_size is not None:
        config._fail("draft_vocab_size", config.draft_vocab_size, f"must be null for {title} "
                     f"({engine} needs the target's vocabulary)")
    for key, off in SCALE_DEFAULTS.items():
        if getattr(config, key) != off:
            config._fail(key, getattr(config, key), f"is not applied by {engine}'s {title} "
                         f"walk; leave it at {off}")


def correction_inputs(drafter, embed: nn.Module, hidden_bnph: Tensor, prev_bnp: Tensor) -> Tensor:
    """Teacher-forced c [Bt, N, B, E]: silu(embed_proj.0([z_t, g_t])) for slots t >= 2, 0 for
    slots 0 and 1. ``prev_bnp``: the token before each slot (slot 1: the anchor), so the GRU
    runs over prev[..., 1:] and slot t reads its output after prev[1..t]."""
    bt, n, b, _ = hidden_bnph.shape
    gru, proj = drafter.prefix_gru, drafter.embed_proj
    x = embed(prev_bnp[..., 1:]).reshape(bt * n, b - 1, -1).to(gru.weight_ih_l0.dtype)
    g = gru(x)[0].reshape(bt, n, b - 1, -1)[:, :, 1:]
    z = hidden_bnph[:, :, 2:].to(g.dtype)
    c = proj[1](proj[0](torch.cat([z, g], -1)))
    return F.pad(c, (0, 0, 2, 0))


@torch.no_grad()
def domino_walk(gru: nn.GRU, proj: nn.Sequential, embed: nn.Module, hidden_kh: Tensor,
                base_kv: Tensor, anchor_id: int, pool: int = 0) -> Tensor:
    """Greedy draft tokens [k] of one block, as SGLang's ``domino_greedy_rollout`` (module
    docstring); ``pool`` 0 or >= V: exact, else the block-shared top-``pool`` candidates."""
    k, vocab = base_kv.shape
    first = base_kv[0].argmax(-1)
    tokens = [first]
    if k == 1:
        return first[None]
    cand = None
    if 0 < pool < vocab:
        cand = base_kv[1:].amax(0).topk(pool, sorted=False).indices
        cand_base, cand_w = base_kv[1:, cand], proj[2].weight[cand]
    anchor = torch.tensor(anchor_id, dtype=torch.long, device=base_kv.device)
    g = gru(embed(torch.stack([anchor, first]))[None].to(gru.weight_ih_l0.dtype))[1][0]
    for i in range(1, k):
        c = proj[1](proj[0](torch.cat([hidden_kh[i][None].to(g.dtype), g], -1)))
        if cand is None:
            tok = (base_kv[i] + proj[2](c)[0]).argmax(-1)
        else:
            tok = cand[(cand_base[i - 1] + cand_w @ c[0]).argmax(-1)]
        tokens.append(tok)
        if i + 1 < k:  # one bias-free GRU step: the op SGLang's ``_domino_gru_cell`` calls
            g = torch.ops.aten.gru_cell.default(embed(tok)[None].to(g.dtype), g,
                                                gru.weight_ih_l0, gru.weight_hh_l0, None, None)
    return torch.stack(tokens)


class Domino(DFlash1):
    name = "domino"
    title = "Domino"
    architecture = "DFlashDraftModel"  # SGLang reads dflash_config.projector_type
    fields = DEFAULTS
    module_settings = SETTINGS
    walk = "GRU walk"
    tensors = "prefix_gru and embed_proj tensors"
    weight_fields = ("gru_hidden_dim", "emb_dim")
    engines = ("sglang",)
    #: no val/tau_T: the GRU walk drafts, not the teacher-forced [W | embed_proj.2] head
    expected_taus = False
    #: the walk's candidate pool: SGLang's --speculative-domino-candidate-pool-size and its
    #: default (0, or >= the vocabulary: the exact walk)
    walk_settings = {"candidate_pool_size": 2048}

    def walk_with(self, config: Any, settings: Any) -> dict[str, Any]:
        out = super().walk_with(config, settings)
        pool = out["candidate_pool_size"]
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise ValueError(f"drafter.walk.candidate_pool_size={pool!r}: give an integer >= 0 "
                             f"(0, or >= vocab_size={config.vocab_size}: the exact walk)")
        return out

    def validate(self, config: Any) -> None:
        """SGLang's ``parse_dflash_draft_config`` rules (``dflash_utils.py:727-791``), plus the
        layout our trainer writes (shift_label false, no sample_from_anchor, full vocabulary,
        unscaled logits: what ``domino_greedy_rollout`` computes)."""
        if config.projector_type != "domino":
            config._fail("projector_type", config.projector_type, "must be 'domino'")
        if config.shift_label is not False:
            config._fail("shift_label", config.shift_label, "must be false (a bool in SGLang; "
                         "our trainer writes the DFlash layout, row t predicts block token t)")
        prefix = config.pure_draft_prefix_len
        if isinstance(prefix, bool) or prefix != 1:
            config._fail("pure_draft_prefix_len", prefix, "must be exactly 1 (SGLang: an "
                         "integer >= 0, and 1; slot 1 keeps the base logits)")
        refuse_unserved(config, ("gru_hidden_dim", "emb_dim"), "SGLang")

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        h, g, e = c.hidden_size, c.gru_hidden_dim, c.emb_dim
        drafter.prefix_gru = nn.GRU(h, g, num_layers=1, batch_first=True, bias=False)
        drafter.embed_proj = nn.Sequential(nn.Linear(h + g, e, bias=False), nn.SiLU(),
                                           nn.Linear(e, c.vocab_size, bias=False))

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """SGLang's four tensors (``srt/models/dflash.py:975-1001``)."""
        h, g, e = config.hidden_size, config.gru_hidden_dim, config.emb_dim
        return {"prefix_gru.weight_ih_l0": (3 * g, h), "prefix_gru.weight_hh_l0": (3 * g, g),
                "embed_proj.0.weight": (e, h + g), "embed_proj.2.weight": (config.vocab_size, e)}

    def head_inputs(self, module: Any, step: Any) -> None:
        """Final logits = [z; c] @ [W_lm | embed_proj.2] (c = 0 on slots 0 and 1)."""
        cfg, drafter = module.drafter.config, module.drafter
        prev = markov_prev_ids(step.batch["input_ids"], step.token_ids, step.anchors,
                               cfg.block_size, cfg.label_shift)
        c = correction_inputs(drafter, module.target_head.embed_tokens, step.hidden, prev)
        step.head_in = torch.cat([step.hidden, c.to(step.hidden.dtype)], -1)
        step.lm_head = ConcatHead(step.lm_head, drafter.embed_proj[2])

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """L(base) at lambda(step) > 0: ``module.loss`` on the same slots and weights as the
        final logits' (SpecForge's CE(base) with module.loss=ce)."""
        trainer = getattr(module, "_trainer", None)
        total = trainer.estimated_stepping_batches if trainer is not None else None
        lam = lambda_base(module.global_step, total, **module.head_settings)
        base = None
        if lam > 0:
            hp = module.hparams
            base = dflash_loss(step.hidden, step.tgt, module.drafter.head(
                module.target_head.lm_head), hp.gamma, hp.ce_chunk_size, None,
                hp.ce_chunk_bytes, **step.weighting, spec=module.loss_spec, teacher=step.teacher)
        out.head_pieces["domino"] = (lam, base)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """lambda L(base) - lambda L(final): with the label term, SpecForge's objective."""
        lam, base = out.head_pieces["domino"]
        if base is None:
            return []
        return [Term("domino_base", base.weighted_sum, base.weight_sum, lam, "base_loss",
                     extra=(("lambda_base", lam),)),
                Term("domino_final", out.weighted_sum, out.weight_sum, -lam, "final_loss")]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """The correction inputs c [1, 1, B, E] and bias [1, 1, B, V] for prev = (anchor,
        then random ids) through an embedding of fixed random rows."""
        gen = torch.Generator().manual_seed(1)
        h, v = hidden_bph.shape[-1], drafter.config.vocab_size
        embed = nn.Embedding.from_pretrained(torch.randn(v, h, generator=gen))
        b = hidden_bph.shape[1]
        prev = torch.cat([anchor_b, anchor_b, torch.randint(0, v, (b - 2,), generator=gen)])
        c = correction_inputs(drafter, embed, hidden_bph[None].float(), prev[None, None])
        return [c, drafter.embed_proj[2](c)]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None, context_h: Any = None) -> tuple[Any, Any]:
        """The greedy walk; q one-hot (a point mass) under rejection sampling at T > 0."""
        if embed_tokens is None:
            raise ValueError("a Domino draft needs the target's embedding table (embed_tokens)")
        tokens = domino_walk(drafter.prefix_gru, drafter.embed_proj, embed_tokens, hidden_kh,
                             unary_kv, anchor_id, drafter.walk_settings["candidate_pool_size"])
        point = temperature > 0 and mode == "rejection"
        return tokens, (F.one_hot(tokens, unary_kv.shape[-1]).float() if point else None)


HEAD = register(Domino())
