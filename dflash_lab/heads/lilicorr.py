"""LiLiCorr (docs/lilicorr.md; spec: docs/design/new_heads.md "LiLiCorr"): the DFlash 1 backbone
(optionally on DFlash 2's conv, imported from heads/dflash2.py) plus a small transformer over
the lattice of every slot's top-K candidates; its scores [S, K, K] (anchor -> slot 0, then
<out[s, i], in[s+1, j]>) drive a left-to-right walk. :class:`LiLiCorrLattice` has vLLM 0.34's
``LiLiCorrHead`` names and math (``lilicorr.py:331-430``), so ``state_dict()`` is what vLLM and
SGLang load as ``LiLiCorrDraftModel``. Walk (``_selector_walk_kernel``): prev = 0, per slot the
row scores[s, prev] alone (no unary prior): argmax, or at T > 0 a sample of softmax(row / T),
the q vLLM's ``probabilistic`` rejection reads. Training: ModelOpt's lattice terms along the gold
path (:func:`lattice_losses`) beside the DFlash CE.

Shape legend: Bt batch, N blocks, B block size, S = B-1 slots, H hidden, h lattice width, K
candidates, V vocab, F factor dim, nh lattice heads, M blocks flattened.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.heads.dflash2 import GroupedDynamicCausalConv
from dflash_lab.model.heads import Head, register
from dflash_lab.train.distill import candidate_logprobs
from dflash_lab.train.objective import Term

#: the conv's keys (DFlash 2's fields: both set = LiLiCorr + conv, neither = plain)
CONV = ("conv_kernel_size", "conv_group_size")
#: ``module.head``: ModelOpt's ``base`` composition (``margin``: {0.125, 0.125, 0.25}).
SETTINGS = {"w_ce": 0.25, "w_margin": 0.0, "w_pen": 0.25, "margin": 2.0}
#: what the engines' LiLiCorr does not compute: scales, a draft vocabulary, the DSpark slots
_OFF = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
        "draft_vocab_size": None, "sample_from_anchor": False}


def _int(v: Any, low: int) -> bool:
    return isinstance(v, int) and v >= low


#: key -> (test, valid range): vLLM ``lilicorr.py:39-43,136-148``, SGLang ``lilicorr_utils.py:
#: 41-104``, ModelOpt (vector_eps in (0, 0.5)); checked in this order
RULES = {
    "lilicorr_candidate_topk": (lambda v, c: _int(v, 1) and v <= min(16, c.vocab_size)
                                and not v & (v - 1), "a power of two in [1, 16], <= vocab_size"),
    "lilicorr_hidden_size": (lambda v, c: _int(v, 0), "an integer >= 0 (0 = hidden_size)"),
    "lilicorr_num_layers": (lambda v, c: _int(v, 1), "an integer >= 1"),
    "lilicorr_num_heads": (lambda v, c: _int(v, 1) and (c.lilicorr_hidden_size or c.hidden_size)
                           % v == 0, "an integer >= 1 dividing the lattice width"),
    "lilicorr_mlp_ratio": (lambda v, c: v > 0, "a number > 0"),
    "lilicorr_factor_dim": (lambda v, c: _int(v, 1), "an integer >= 1"),
    "lilicorr_vector_eps": (lambda v, c: 0 < v < 0.5, "in (0, 0.5)"),
    "lilicorr_logit_scale": (lambda v, c: v > 0, "a number > 0"),
}


class _MLP(nn.Module):
    """down(silu(up(x))), both with a bias (vLLM's ``NemotronHMLP``: not gated)."""

    def __init__(self, inp: int, mid: int, out: int):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(inp, mid), nn.Linear(mid, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _Layer(nn.Module):
    """x + attn(attn_norm(x)) with the per-head bias (full attention; nn.MultiheadAttention's
    tensors, vLLM's names), then x + mlp(mlp_norm(x))."""

    def __init__(self, h: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.attn, self.mlp = nn.MultiheadAttention(h, heads, batch_first=True), _MLP(h, mlp, h)

    def forward(self, x_blh: Tensor, bias_bnll: Tensor) -> Tensor:
        b, n, h = x_blh.shape
        a = self.attn
        q, k, v = (t.view(b, n, a.num_heads, -1).transpose(1, 2) for t in F.linear(
            self.attn_norm(x_blh), a.in_proj_weight, a.in_proj_bias).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias_bnll.to(q.dtype))
        x_blh = x_blh + a.out_proj(out.transpose(1, 2).reshape(b, n, h))
        return x_blh + self.mlp(self.mlp_norm(x_blh))


class LiLiCorrLattice(nn.Module):
    """vLLM's ``LiLiCorrHead`` (tensor names and math); :meth:`forward` -> scores [b, S, K, K]."""

    def __init__(self, config: Any):
        super().__init__()
        big, c = config.hidden_size, config
        h = c.lilicorr_hidden_size or big
        k, b, heads = c.lilicorr_candidate_topk, c.block_size, c.lilicorr_num_heads
        self.k, self.block_size, self.eps, self.scale = k, b, c.lilicorr_vector_eps, \
            c.lilicorr_logit_scale
        self.token_proj = nn.Identity() if h == big else nn.Linear(big, h)
        self.pass_hidden_proj, self.context_proj = nn.Linear(big, h), nn.Linear(big, h)
        self.feature_norm, self.feature_mlp = nn.LayerNorm(5), _MLP(5, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, b - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * b - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.layers = nn.ModuleList(_Layer(h, heads, int(h * c.lilicorr_mlp_ratio),
                                           c.rms_norm_eps) for _ in range(c.lilicorr_num_layers))
        self.output_norm, self.anchor_norm = (nn.RMSNorm(h, eps=c.rms_norm_eps) for _ in "ab")
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head, self.in_head, self.anchor_out_head = (nn.Linear(h, c.lilicorr_factor_dim)
                                                             for _ in "abc")

    def forward(self, emb_bskh: Tensor, lp_bsk: Tensor, pass_bsh: Tensor, anchor_bh: Tensor,
                valid_b: Tensor) -> Tensor:
        """Scores [b, S, K, K] fp32; row 0 is the start scores broadcast over i (the walk
        starts at predecessor 0). ``lp``: the candidates' log-probs (descending)."""
        b, s, k = lp_bsk.shape
        lp = lp_bsk.float()
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype) / max(k - 1, 1)
        feat = torch.stack([lp, lp.exp(), lp - lp.amax(-1, keepdim=True), rank.expand_as(lp),
                            (rank == 0).to(lp.dtype).expand_as(lp)], -1)
        dtype = self.slot_embedding.dtype
        x = (self.token_proj(emb_bskh.to(dtype)) + self.pass_hidden_proj(pass_bsh.to(dtype))[
            :, :, None] + self.feature_mlp(self.feature_norm(feat.to(dtype)))
            + self.slot_embedding[:, 0, :s] + self.rank_embedding[:, 0]).reshape(b, s * k, -1)
        # [1, nh, S*K, S*K]: relative_slot_bias[slot(q) - slot(k) + B - 1] + same_slot_bias
        slot = torch.arange(s, device=lp.device).repeat_interleave(k)
        rel = slot[:, None] - slot[None, :]
        bias = (self.relative_slot_bias[:, rel + self.block_size - 1] + (rel == 0).to(dtype)
                * self.same_slot_bias[:, None, None])[None]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(b, s, k, -1)
        a = self.anchor_norm(self.context_proj(anchor_bh.to(dtype)) * valid_b[:, None].to(dtype))
        row = a[:, None, None]
        f = F.silu(self.factor_input_proj(torch.cat([x, row.expand_as(x), x * row], -1)))
        out, inc, a_out = (F.normalize(head(x), dim=-1, eps=self.eps) for head, x in (
            (self.out_head, f), (self.in_head, f), (self.anchor_out_head, a)))
        start = (a_out[:, None] * inc[:, 0]).sum(-1)[:, None, None].expand(b, 1, k, k)
        pair = out[:, :-1] @ inc[:, 1:].transpose(-1, -2)  # [b, S-1, K, K]
        return self.scale * torch.cat([start, pair], 1).float()

    def candidates(self, unary_xv: Tensor) -> tuple[Tensor, Tensor]:
        """(log-probs, ids) [x, K] of the top-K of log_softmax(unary) over the full vocabulary."""
        return F.log_softmax(unary_xv.float(), -1).topk(self.k, -1)


def lattice_walk(scores_bskk: Tensor, pick=None) -> Tensor:
    """Candidate index [b, S] per slot: prev = 0, idx_s = pick(scores[:, s, prev]) (argmax)."""
    rows = torch.arange(scores_bskk.shape[0], device=scores_bskk.device)
    prev, picks = torch.zeros_like(rows), []
    for s in range(scores_bskk.shape[1]):
        row = scores_bskk[rows, s, prev]
        prev = row.argmax(-1) if pick is None else pick(row)
        picks.append(prev)
    return torch.stack(picks, 1)


def lattice_losses(scores: Tensor, ids: Tensor, labels: Tensor, ok: Tensor, tl: Tensor | None,
                   margin: float) -> tuple[Tensor, dict[str, Tensor]]:
    """ModelOpt's lattice terms, summed over the supervised slots. scores [M, S, K, K], ids
    [M, S, K], labels [M, S], ok [M] (a block whose every slot is valid), tl [M, S, K] target
    logits of the candidates (or None). Returns (supervised [M, S], name -> sum)."""
    hit = ids == labels[..., None]
    gold = hit.float().argmax(-1)  # [M, S]
    sup = torch.cumprod(hit.any(-1).long(), -1).bool() & ok[:, None]
    prev = F.pad(gold[:, :-1], (1, 0))
    node = scores.gather(2, prev[..., None, None].expand(-1, -1, 1, scores.shape[-1]))[:, :, 0]
    node_gold = node.gather(-1, gold[..., None])[..., 0]
    rival = node.masked_fill(F.one_hot(gold, node.shape[-1]).bool(), float("-inf")).amax(-1)
    pieces = {"ce": node.logsumexp(-1) - node_gold,  # the hinge is 0 at K = 1 (no rival)
              "margin": F.relu(margin - (node_gold - rival))}
    if tl is not None:
        gap = F.relu(tl.gather(-1, gold[..., None]) - tl)
        pieces["pen"] = (node.softmax(-1) * gap).sum(-1)
    return sup, {key: (value * sup).sum() for key, value in pieces.items()}


class LiLiCorr(Head):
    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"
    fields = {**dict.fromkeys(RULES), **dict.fromkeys(CONV)}
    module_settings = SETTINGS
    walk = "lattice walk"
    tensors = "lilicorr lattice (and conv) tensors"
    weight_fields = (*list(RULES)[:6], *CONV)  # all but vector_eps and logit_scale
    expected_taus = False
    reads_context = True

    def validate(self, config: Any) -> None:
        """The engines' refusals (new_heads.md LiLiCorr (a)), and the layout they compute: DFlash
        slots, the full target vocabulary, unscaled logits."""
        for key, (ok, valid) in RULES.items():
            value = getattr(config, key)
            if value is None or isinstance(value, bool) or not ok(value, config):
                config._fail(key, value, f"must be {valid}" + (" (required: no engine defaults "
                                                                 "it)" if value is None else ""))
        kc, g = config.conv_kernel_size, config.conv_group_size
        if (kc is None) != (g is None):
            config._fail("conv_kernel_size" if kc is None else "conv_group_size", None,
                         "conv_kernel_size and conv_group_size are set both or neither")
        if kc is not None and not (isinstance(kc, int) and 1 <= kc <= config.block_size):
            config._fail("conv_kernel_size", kc, f"must be in [1, {config.block_size}]")
        if g is not None and not (isinstance(g, int) and g > 0 and config.hidden_size % g == 0):
            config._fail("conv_group_size", g, f"must divide hidden_size={config.hidden_size}")
        for key, off in _OFF.items():
            if getattr(config, key) != off:
                config._fail(key, getattr(config, key), f"is not applied by the engines' "
                             f"LiLiCorr (no draft vocabulary, DFlash slots); leave it at {off}")

    def serving_keys(self, config: Any) -> dict[str, Any]:
        """The eight keys; the conv's two only when set (both-or-neither)."""
        return {k: getattr(config, k) for k in self.fields
                if k in RULES or getattr(config, k) is not None}

    def attach(self, drafter: Any) -> None:
        drafter.lilicorr = LiLiCorrLattice(drafter.config)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """new_heads.md LiLiCorr (b): what vLLM's and SGLang's loaders place (+ the convs)."""
        from dflash_lab.model.drafter import DFlashDrafter

        with torch.device("meta"):
            state = DFlashDrafter(config).state_dict()
        return {n: tuple(t.shape) for n, t in state.items()
                if n.startswith("lilicorr.") or "_conv." in n}

    def layer_modules(self, config: Any) -> dict[str, Any]:
        return {} if config.conv_kernel_size is None else {name: GroupedDynamicCausalConv(
            config.hidden_size, config.conv_kernel_size, config.conv_group_size,
            config.block_size) for name in ("attention_conv", "mlp_conv")}

    def min_slots(self, config: Any) -> int:
        """The full block: the slot embeddings are sized by the trained block, so a short tail
        block is drafted as a full one and its first drafts kept."""
        return config.block_size

    def needs_distribution(self, module: Any) -> str | None:
        return "module.head.w_pen" if module.head_settings["w_pen"] > 0 else None

    def check_training(self, config: Any, module: Any) -> None:
        weights = [module.head_settings[k] for k in ("w_ce", "w_margin", "w_pen")]
        if min(weights) < 0 or not any(weights) or module.head_settings["margin"] < 0:
            raise ValueError(f"module.head: LiLiCorr's w_ce, w_margin, w_pen {weights} must be "
                             ">= 0 and not all zero, margin >= 0 (ModelOpt)")

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """The lattice of every block's top-K (log-probs from the live logits, so the terms
        reach the backbone) over the anchor row: the fused context row before the anchor
        (invalid at a sequence or document start); its three sums, the count of supervised
        slots and the greedy walk's accepted prefix."""
        drafter, hp, tgt, batch = module.drafter, module.head_settings, step.tgt, step.batch
        p = step.hidden[:, :, 1:]  # [Bt, N, S, H]
        lp, ids = drafter.lilicorr.candidates(step.lm_head(p.to(step.lm_head.weight.dtype)))
        before = (step.anchors - 1).clamp(min=0)
        anchor = drafter.fuse(batch["hidden"].gather(1, before[..., None].expand(
            -1, -1, batch["hidden"].shape[-1])))
        valid, docs = step.anchors >= 1, batch.get("document_ids")
        if docs is not None:
            valid = valid & (docs.gather(1, before) == docs.gather(1, step.anchors))
        scores = drafter.lilicorr(module.target_head.embed_tokens(ids).flatten(0, 1),
                                  lp.flatten(0, 1), p.flatten(0, 1), anchor.flatten(0, 1),
                                  valid.flatten())
        tl = None
        if hp["w_pen"] > 0:  # the teacher's rows are the valid slots' (slot 0 never is)
            full = F.pad(ids, (0, 0, 1, 0))
            tl = torch.zeros(full.shape, device=ids.device)
            tl[tgt.valid] = candidate_logprobs(step.teacher, full[tgt.valid], step.lm_head,
                                               renormalise=False)
            tl = tl[:, :, 1:].flatten(0, 1)
        labels, ok = tgt.labels[:, :, 1:].flatten(0, 1), tgt.valid[:, :, 1:].all(-1).flatten()
        ids = ids.flatten(0, 1)
        sup, sums = lattice_losses(scores, ids, labels, ok, tl, hp["margin"])
        right = ids.gather(-1, lattice_walk(scores.detach())[..., None])[..., 0] == labels
        prefix = (right.long().cumprod(-1).sum(-1) * ok).sum() / ok.sum().clamp(min=1)
        out.head_pieces["lilicorr"] = (sums, sup.sum().float(), prefix.float())

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """w_ce, w_margin, w_pen x the mean over supervised slots (each even at weight 0: every
        parameter stays in the graph under DDP; pen where it is computed)."""
        sums, count, prefix = out.head_pieces["lilicorr"]
        return [Term(f"lilicorr_{key}", value, count, module.head_settings[f"w_{key}"],
                     f"lilicorr_{key}_loss", extra=(("lilicorr_selected_prefix", prefix),)
                     if key == "ce" else ()) for key, value in sums.items()]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """The lattice scores [1, B-1, K, K] of the probe block (embedding rows from a fixed
        random table, the probe's slot-0 row as the anchor row)."""
        lp, ids = drafter.lilicorr.candidates(unary_bpv[:, 1:])
        emb = torch.randn(drafter.config.vocab_size, hidden_bph.shape[-1],
                          generator=torch.Generator().manual_seed(1))[ids]
        h = hidden_bph.float()
        return [drafter.lilicorr(emb, lp, h[:, 1:], h[:, 0], torch.ones(1))]

    @torch.no_grad()
    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any, embed_tokens: Any = None,
              context_h: Any = None) -> tuple[Any, Any]:
        """vLLM's walk: greedy, or at T > 0 under rejection q = softmax(row / T) over the K
        candidates (dense over the vocabulary, zero elsewhere)."""
        if embed_tokens is None or context_h is None:
            raise ValueError("a LiLiCorr draft needs the target's embedding table and the "
                             "context row before the anchor (embed_tokens, context_h)")
        lp, ids = drafter.lilicorr.candidates(unary_kv)
        scores = drafter.lilicorr(embed_tokens(ids)[None], lp[None], hidden_kh[None],
                                  context_h[None], torch.ones(1, device=lp.device))
        rows: list[Tensor] = []

        def pick(row_bk: Tensor) -> Tensor:
            rows.append(torch.softmax(row_bk / temperature, -1))
            return torch.multinomial(rows[-1], 1, generator=generator)[:, 0]

        sampled = temperature > 0 and mode == "rejection"
        tokens = ids.gather(-1, lattice_walk(scores, pick if sampled else None)[0][:, None])[:, 0]
        if not sampled:
            return tokens, None
        return tokens, unary_kv.new_zeros(unary_kv.shape).float().scatter_(-1, ids,
                                                                            torch.cat(rows))


HEAD = register(LiLiCorr())
