"""DSpark: the DFlash 1 backbone plus a Markov logit-bias head over the previous token and a
confidence head, their training terms, draft walk and head (docs/dspark.md, "Heads" to "Identity
init"). Shapes: x any leading dims, k slots of one block, H hidden, r markov rank, V target
vocab; N the draft vocab in the heads, blocks in training; Bt batch, S sequence, B block size,
M supervised slots, V' head vocabulary (V, or N with a draft vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.eval.sampling import probs_at
from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.model.config import SCALE_DEFAULTS
from dflash_lab.model.heads import register
from dflash_lab.train.loss import position_weights, slot_positions
from dflash_lab.train.objective import Term

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """Low-rank bias over the draft vocabulary from the previous token (module docstring)."""

    owns_init = True  #: re-initialised by reset_parameters after the drafter's init

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, rank: int,
                 head_type: str = "vanilla"):
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type={head_type!r}: use one of "
                             f"{list(MARKOV_HEAD_TYPES)}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """w1 N(0, 0.01) (speculators'), w2 = 0 (identity: zero bias), projections N(0, 0.02)
        with zero bias (the drafter's Linear rule)."""
        with torch.no_grad():
            nn.init.normal_(self.markov_w1.weight, std=0.01)
            self.markov_w2.weight.zero_()
            for name in ("gate_proj", "joint_proj"):
                proj = getattr(self, name, None)
                if proj is not None:
                    nn.init.normal_(proj.weight, std=0.02)
                    proj.bias.zero_()

    def embed(self, prev_ids_x: Tensor) -> Tensor:
        """``e = markov_w1[prev]`` [x, r] of previous-token ids [x] (target vocabulary)."""
        return self.markov_w1(prev_ids_x.long())

    def step(self, emb_xr: Tensor, hidden_xh: Tensor, state_xr: Tensor | None
             ) -> tuple[Tensor, Tensor | None]:
        """One slot: (feature f [x, r], next rnn state or None) from e [x, r] and h [x, H]."""
        if self.head_type == "vanilla":
            return emb_xr, None
        hidden_xh = hidden_xh.to(emb_xr.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_xh, emb_xr], dim=-1)))
            return gate * emb_xr, None
        if state_xr is None:
            state_xr = emb_xr.new_zeros(emb_xr.shape)
        g, c, o = self.joint_proj(torch.cat([state_xr, emb_xr, hidden_xh], dim=-1)).chunk(3, -1)
        g = torch.sigmoid(g)
        state_xr = g * state_xr + (1.0 - g) * torch.tanh(c)
        return torch.tanh(o), state_xr

    def features(self, prev_ids_xk: Tensor, hidden_xkh: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced features f [x, k, r] and embeddings e [x, k, r] of a block's k slots
        (``prev_ids_xk``: the token before each slot; the rnn state runs along k)."""
        emb = self.embed(prev_ids_xk).to(self.markov_w2.weight.dtype)
        if self.head_type != "rnn":
            return self.step(emb, hidden_xkh, None)[0], emb
        state, feats = None, []
        for k in range(emb.shape[-2]):
            f, state = self.step(emb[..., k, :], hidden_xkh[..., k, :], state)
            feats.append(f)
        return torch.stack(feats, dim=-2), emb

    def bias(self, features_xr: Tensor) -> Tensor:
        """The logit bias [x, N] over the draft vocabulary."""
        return self.markov_w2(features_xr)

    @torch.no_grad()
    def walk(self, base_logits_kv: Tensor, hidden_kh: Tensor, anchor_id: int,
             pick: Callable[[Tensor], Tensor], to_vocab: Callable[[Tensor], Tensor]
             ) -> tuple[Tensor, Tensor]:
        """vLLM's sequential draft of one block: (tokens [k], embeddings e [k, r]) from the
        drafting slots' backbone logits [k, V'] (V' = what ``pick`` reads); ``to_vocab``: a bias
        [N] into that space (identity without a draft vocabulary); ``pick``: logits [V'] ->
        token id (argmax, or a sample). ``prev``: the anchor, then each drafted token."""
        prev = torch.tensor(anchor_id, dtype=torch.long, device=base_logits_kv.device)
        state, tokens, embs = None, [], []
        for k in range(base_logits_kv.shape[0]):
            emb = self.embed(prev).to(self.markov_w2.weight.dtype)
            f, state = self.step(emb, hidden_kh[k], state)
            prev = pick(base_logits_kv[k] + to_vocab(self.bias(f)).to(base_logits_kv.dtype))
            tokens.append(prev)
            embs.append(emb)
        return torch.stack(tokens), torch.stack(embs)


class ConfidenceHead(nn.Module):
    """Acceptance-probability logit per slot: ``proj([h; e])`` (or ``proj(h)``) -> [x]."""

    owns_init = True  #: re-initialised by reset_parameters after the drafter's init

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.proj.weight, std=0.02)
            self.proj.bias.zero_()

    def forward(self, hidden_xh: Tensor, emb_xr: Tensor | None) -> Tensor:
        """Logits [x] (float32, as vLLM computes them); ``emb_xr`` is used iff with_markov."""
        x = torch.cat([hidden_xh, emb_xr.to(hidden_xh.dtype)], -1) if self.with_markov \
            else hidden_xh
        return self.proj(x.to(self.proj.weight.dtype)).float().squeeze(-1)


class ConcatHead(nn.Module):
    """``lm_head(h) + markov_w2(f)`` as one linear map of ``[h; f]`` [x, H + r] -> [x, V']; the
    weight, built once per step (it carries markov_w2's gradient), is in the LM head's dtype, as
    the unary head computes."""

    linear_map = True  #: logits = x @ weight.T (the distribution pass reads the weight)

    def __init__(self, lm_head: nn.Module, markov_w2: nn.Linear):
        super().__init__()
        w = lm_head.weight
        self.weight = torch.cat([w, markov_w2.weight.to(w.dtype)], dim=1)
        self.out_features = w.shape[0]

    def forward(self, x_xf: Tensor) -> Tensor:
        return F.linear(x_xf.to(self.weight.dtype), self.weight)


def markov_prev_ids(input_ids_bs: Tensor, targets_bs: Tensor, anchors_bn: Tensor,
                    block_size: int, label_shift: int) -> Tensor:
    """The token before each slot's predicted position [Bt, N, B] (target vocabulary): the
    anchor's token at or before the anchor, else the label there (the data token where the
    label is missing, -1)."""
    seq = input_ids_bs.shape[1]
    before = slot_positions(anchors_bn, block_size, label_shift) - 1
    flat = before.clamp(0, seq - 1).flatten(1)
    labels = targets_bs.gather(1, flat).view_as(before)
    data = input_ids_bs.gather(1, flat).view_as(before)
    anchor_tok = input_ids_bs.gather(1, anchors_bn)[..., None].expand_as(before)
    inner = torch.where(labels >= 0, labels, data)
    return torch.where(before <= anchors_bn[..., None], anchor_tok, inner)


@dataclass
class ConfidenceOutput:
    """The confidence BCE's local pieces: sum of w_t x BCE, the number of supervised slots,
    and the sum of |sigmoid(logit) - c*| (calibration metric), all over the M valid slots."""

    weighted_sum: Tensor
    count: Tensor
    abs_error_sum: Tensor


def bias_in_vocab(drafter, bias_xn: Tensor) -> Tensor:
    """A Markov bias over the draft vocabulary [x, N] in the target vocabulary [x, V] (0
    outside the draft vocabulary, whose logits are -inf anyway)."""
    if drafter.lm_head is None:
        return bias_xn
    full = bias_xn.new_zeros((*bias_xn.shape[:-1], drafter.config.vocab_size))
    full[..., drafter.draft_token_ids()] = bias_xn
    return full


#: Defaults when ``variant=dspark`` leaves them unset: speculators 0.9.0's
#: ``DSparkSpeculatorConfig`` defaults.
DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True}


class DSpark(DFlash1):
    name = "dspark"
    title = "DSpark"
    architecture = "Qwen3DSparkModel"  # vLLM's name (qwen3_dspark.py)
    fields = DEFAULTS
    walk = "Markov walk"
    tensors = "Markov and confidence head tensors"
    weight_fields = tuple(DEFAULTS)
    #: no val/tau_T: the Markov walk drafts, not the teacher-forced [W | markov_w2] head
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
        for key, off in SCALE_DEFAULTS.items():
            if getattr(config, key) != off:
                config._fail(key, getattr(config, key), "is not implemented for "
                             "variant='dspark' (vLLM scales the backbone logits and the Markov "
                             f"bias apart); leave it at {off}")

    def attach(self, drafter: Any) -> None:
        """The Markov head (markov_rank > 0) and the confidence head (None where absent)."""
        c = drafter.config
        drafter.markov_head = drafter.confidence_head = None
        if c.markov_rank > 0:
            drafter.markov_head = MarkovHead(c.hidden_size, c.vocab_size,
                                             c.draft_vocab_size or c.vocab_size, c.markov_rank,
                                             c.markov_head_type)
        if c.enable_confidence_head:
            drafter.confidence_head = ConfidenceHead(c.hidden_size, c.markov_rank,
                                                     c.confidence_head_with_markov)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """speculators' and vLLM's names: Markov w1 [V, r], w2 [N, r], gated gate_proj [r, H + r]
        + bias, rnn joint_proj [3r, 2r + H] + bias; confidence proj [1, H (+ r)] + bias."""
        h, r = config.hidden_size, config.markov_rank
        n = config.draft_vocab_size or config.vocab_size
        shapes: dict[str, tuple[int, ...]] = {}
        if r:
            shapes.update({"markov_head.markov_w1.weight": (config.vocab_size, r),
                           "markov_head.markov_w2.weight": (n, r)})
            extra = {"gated": ("gate_proj", (r, h + r)),
                     "rnn": ("joint_proj", (3 * r, 2 * r + h))}.get(config.markov_head_type)
            if extra is not None:
                shapes[f"markov_head.{extra[0]}.weight"] = extra[1]
                shapes[f"markov_head.{extra[0]}.bias"] = (extra[1][0],)
        if config.enable_confidence_head:
            width = h + (r if config.confidence_head_with_markov and r else 0)
            shapes.update({"confidence_head.proj.weight": (1, width),
                           "confidence_head.proj.bias": (1,)})
        return shapes

    def head_inputs(self, module: Any, step: Any) -> None:
        """The Markov bias joins the head: the CE reads ``[h; f]`` [Bt, N, B, H + r] with
        :class:`ConcatHead` ``[W_lm | markov_w2]``, ``step.emb`` e [Bt, N, B, r]; without a
        Markov head ``h``, the head and None."""
        cfg, markov = module.drafter.config, module.drafter.markov_head
        step.emb = None
        if markov is None:
            return
        prev = markov_prev_ids(step.batch["input_ids"], step.token_ids, step.anchors,
                               cfg.block_size, cfg.label_shift)
        feats, step.emb = markov.features(prev, step.hidden)
        step.head_in = torch.cat([step.hidden, feats.to(step.hidden.dtype)], -1)
        step.lm_head = ConcatHead(step.lm_head, markov.markov_w2)

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """speculators' confidence term on the M valid slots (module docstring); None without a
        confidence head or when the loss pass gave no per-slot CE (validation at temperatures)."""
        head, emb = module.drafter.confidence_head, step.emb
        if head is None or out.slot_ce is None:
            out.head_pieces["confidence"] = None
            return
        sel = out.valid
        target = torch.exp(-out.slot_ce.detach().float())  # q(label): one-hot teacher's 1 - TV
        logits = head(step.hidden[sel], None if emb is None else emb[sel])
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        w = position_weights(sel.shape[-1], module.hparams.gamma, sel.device,
                             out.first_slot).expand_as(sel)[sel]
        err = (torch.sigmoid(logits.detach()) - target).abs().sum()
        out.head_pieces["confidence"] = ConfidenceOutput((w * bce).sum(), sel.sum().float(), err)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """The confidence BCE per supervised slot (speculators' mean), where a head is."""
        conf = out.head_pieces.get("confidence")
        if conf is None:
            return []
        return [Term("confidence", conf.weighted_sum, conf.count,
                     module.hparams.confidence_head_alpha, "confidence_loss",
                     extra=(("confidence_abs_error",
                             conf.abs_error_sum / conf.count.clamp(min=1)),))]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """Markov bias [B, N] for prev = (anchor, then random ids) and the confidence logits
        [B] (with a Markov head; none without, as the draft is the backbone's)."""
        head, hidden_kh = drafter.markov_head, hidden_bph[0].float()
        if head is None:
            return []
        gen = torch.Generator().manual_seed(1)
        vocab = head.markov_w1.num_embeddings
        prev = torch.cat([anchor_b, torch.randint(0, vocab, (hidden_kh.shape[0] - 1,),
                                                  generator=gen)])
        feats, emb = head.features(prev[None], hidden_kh[None])
        out = [head.bias(feats)[0]]
        if drafter.confidence_head is not None:
            out.append(drafter.confidence_head(hidden_kh[None], emb)[0])
        return out

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None, context_h: Any = None) -> tuple[Any, Any] | None:
        """DSpark draft tokens [k] (and q [k, V] for rejection sampling, else None): vLLM's walk
        (:meth:`~MarkovHead.walk`) over the drafting slots' unary logits, each biased by the
        token before it (the anchor first); q of slot t = softmax((unary_t + bias(prev_t)) / T),
        the distribution the token was drawn from. None without a Markov head (markov_rank 0:
        the backbone's draft)."""
        if drafter.markov_head is None:
            return None
        rows: list[Tensor] = []
        sample = temperature > 0 and mode == "rejection"

        def pick(logits_v: Tensor) -> Tensor:
            if not sample:
                return logits_v.argmax(-1)
            q_v = probs_at(logits_v, temperature)
            rows.append(q_v)
            return torch.multinomial(q_v, 1, generator=generator)[0]

        tokens, _ = drafter.markov_head.walk(unary_kv.float(), hidden_kh, anchor_id, pick,
                                             lambda bias_n: bias_in_vocab(drafter, bias_n))
        return tokens, (torch.stack(rows) if sample else None)


HEAD = register(DSpark())
