"""DSpark heads: the Markov logit-bias head and the confidence head (docs/dspark.md).

What DSpark is (speculators 0.9.0 ``models/dspark``; vLLM 0.32 ``qwen3_dspark.py`` and
``v1/worker/gpu/spec_decode/dspark/speculator.py``): the DFlash 1 backbone (fc, hidden_norm,
draft layers, norm; one parallel pass over anchor + MASK slots) plus two small heads.

- Markov head, rank r (``markov_rank``; speculators' default 256, 0 = no head): ``markov_w1``
  [V, r] is an embedding of the PREVIOUS token (target vocabulary), ``markov_w2`` [N, r] (no bias)
  projects an r-vector to a bias over the draft vocabulary N (= V without a draft vocabulary),
  added to the backbone's logits of the slot: ``logits_k = lm_head(h_k) + markov_w2(f_k)``. The
  feature ``f_k`` of slot k, with ``e_k = markov_w1[prev_k]`` (``markov_head_type``):

  * ``vanilla``: ``f_k = e_k`` (a first-order, low-rank transition bias B = W1 W2^T);
  * ``gated``:   ``f_k = sigmoid(gate_proj([h_k; e_k])) * e_k``, gate_proj [r, H + r] + bias;
  * ``rnn``:     state ``s_0 = 0``; ``g, c, o = chunk3(joint_proj([s_{k-1}; e_k; h_k]))``
    (joint_proj [3r, 2r + H] + bias), ``s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)``,
    ``f_k = tanh(o)``; the state runs over the block's slots left to right.

- Confidence head (``enable_confidence_head``): ``proj`` [1, H (+ r)] + bias, a logit of the
  slot's acceptance probability from ``h_k`` (concatenated with ``e_k`` when
  ``confidence_head_with_markov``, which needs r > 0). vLLM computes it in float32 and uses
  ``sigmoid`` of it for adaptive verification (draft-length cut); it never changes a token.

Drafting (vLLM's ``_sample_sequential``): one backbone pass gives every slot's base logits;
then left to right, ``prev`` = the anchor token for the first drafting slot and the token just
drafted for each later one; slot k's logits get the bias from ``prev`` and the token is sampled
(greedy: argmax) from them. The Markov head only ever sees tokens of the current block.
:meth:`MarkovHead.walk` is that walk.

Training prev tokens (teacher forcing): speculators takes the data tokens before each slot
(with ``sample_from_anchor`` slot k predicts a + k + 1 and conditions on the token at a + k).
Identity init (ours, not speculators'): ``markov_w2 = 0`` so a fresh drafter's bias is zero for
every head type and it drafts exactly as DFlash 1 with the same backbone; ``markov_w1`` is
N(0, 0.01) as speculators inits it, so ``markov_w2`` gets a gradient from the first step.

Checkpoint names (speculators and vLLM agree): ``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``markov_head.gate_proj.{weight,bias}`` (gated),
``markov_head.joint_proj.{weight,bias}`` (rnn), ``confidence_head.proj.{weight,bias}``.
vLLM 0.32 builds only the vanilla head (Qwen3DSparkModel has no gate/joint projection).

Shape legend: x any leading dims, k slots of one block, H hidden, r markov rank, V target
vocab, N draft vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

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
        """vLLM's sequential draft of one block: (tokens [k], embeddings e [k, r]).

        ``base_logits_kv``: the drafting slots' backbone logits [k, V'] (V' = what ``pick``
        reads); ``to_vocab`` turns a bias [N] into that space (identity without a draft
        vocabulary); ``pick``: logits [V'] -> token id (argmax, or a sample). The first ``prev``
        is the anchor, then each drafted token."""
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
