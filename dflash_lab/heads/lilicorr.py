"""LiLiCorr (docs/design/new_heads.md, "LiLiCorr"): the DFlash 1 backbone (optionally with DFlash
2's conv, imported from heads/dflash2.py) plus a small transformer over the lattice of every
slot's top-K candidates that scores each transition between neighbouring slots' candidates;
the draft is a left-to-right walk over those scores.

Served as ``LiLiCorrDraftModel`` by vLLM 0.34 and SGLang 0.5.23 (``dflash_config.lilicorr_*``,
none with a default: a defaulted ``logit_scale`` would load and score another function). The
lattice module :class:`LiLiCorrLattice` carries vLLM's names (``lilicorr.*``) and runs vLLM's
``LiLiCorrHead.score/forward`` (``lilicorr.py:331-430``): per slot s and candidate k,
x = token_proj(E[id]) + pass_hidden_proj(P_s) + feature_mlp(feature_norm(feat)) + slot and
rank embeddings, nh-head full attention over the S*K lattice with a learned slot-distance bias,
then out/in factor vectors; scores [S, K, K] = logit_scale * (start from the anchor row, then
<out[s, i], in[s+1, j]>). Walk (``_selector_walk_kernel``): prev = 0; per slot the row
scores[s, prev] alone (no unary prior), argmax, or at T > 0 a sample of softmax(row / T), the
q vLLM's ``probabilistic`` rejection reads.

Training (ModelOpt ``HFLiLiCorrModel``): the DFlash CE plus, per fully-valid block, the lattice
terms along the gold path (teacher forcing: node_0 = start, node_s = scores[s, gold_{s-1}]) on
the slots whose gold is in every lattice so far: w_ce CE(node, gold), w_margin hinge on the
gold's lead, w_pen E_{softmax(node)}[relu(target logit(gold) - target logit(c))].

Shape legend: Bt batch, N blocks, B block size, S = B-1 slots, H hidden, h lattice width, K
candidates, V vocab, F factor dim, nh lattice heads, m = int(h * mlp_ratio).
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

#: The eight required keys (no defaults, as vLLM, SGLang and ModelOpt), then the conv's two
#: (DFlash 2's fields: both set = LiLiCorr + conv, neither = plain).
REQUIRED = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
            "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
            "lilicorr_vector_eps", "lilicorr_logit_scale")
CONV = ("conv_kernel_size", "conv_group_size")
#: ``module.head``: ModelOpt's ``base`` composition (``margin``: {0.125, 0.125, 0.25}).
SETTINGS = {"w_ce": 0.25, "w_margin": 0.0, "w_pen": 0.25, "margin": 2.0}
_SCALES_OFF = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
               "final_logit_softcapping": None}


class _MLP(nn.Module):
    """down(silu(up(x))), both with a bias (vLLM's ``NemotronHMLP``: not gated)."""

    def __init__(self, inp: int, mid: int, out: int):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(inp, mid), nn.Linear(mid, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _Attention(nn.Module):
    """Full attention with an additive per-head bias (nn.MultiheadAttention's tensor names)."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * h, h))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * h))
        self.out_proj = nn.Linear(h, h)

    def forward(self, x_blh: Tensor, bias_bnll: Tensor) -> Tensor:
        b, n, h = x_blh.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in F.linear(x_blh, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias_bnll.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h))


class _Layer(nn.Module):
    def __init__(self, h: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.attn, self.mlp = _Attention(h, heads), _MLP(h, mlp, h)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrLattice(nn.Module):
    """vLLM's ``LiLiCorrHead`` (tensor names and math); :meth:`forward` -> scores [b, S, K, K]."""

    owns_init = True

    def __init__(self, config: Any):
        super().__init__()
        big, c = config.hidden_size, config
        h = c.lilicorr_hidden_size or big
        k, b, heads = c.lilicorr_candidate_topk, c.block_size, c.lilicorr_num_heads
        self.h, self.k, self.block_size = h, k, b
        self.factor_dim, self.eps, self.scale = (c.lilicorr_factor_dim, c.lilicorr_vector_eps,
                                                 c.lilicorr_logit_scale)
        self.token_proj = nn.Identity() if h == big else nn.Linear(big, h)
        self.pass_hidden_proj = nn.Linear(big, h)
        self.feature_norm = nn.LayerNorm(5)
        self.feature_mlp = _MLP(5, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, b - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * b - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(big, h)
        self.layers = nn.ModuleList(_Layer(h, heads, int(h * c.lilicorr_mlp_ratio),
                                           c.rms_norm_eps) for _ in range(c.lilicorr_num_layers))
        self.output_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.anchor_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head, self.in_head, self.anchor_out_head = (nn.Linear(h, self.factor_dim)
                                                             for _ in range(3))

    def reset_parameters(self) -> None:
        """The attention's in-projection as every Linear (normal(0, 0.02), bias 0)."""
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=0.02)
            nn.init.zeros_(layer.attn.in_proj_bias)

    def attention_bias(self, slots: int) -> Tensor:
        """[nh, S*K, S*K]: relative_slot_bias[slot(q) - slot(k) + B - 1] + same_slot_bias."""
        ids = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.k)
        rel = ids[:, None] - ids[None, :]
        return (self.relative_slot_bias[:, rel + self.block_size - 1]
                + (rel == 0).to(self.same_slot_bias.dtype) * self.same_slot_bias[:, None, None])

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
        bias = self.attention_bias(s)[None]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(b, s, k, -1)
        a = self.anchor_norm(self.context_proj(anchor_bh.to(dtype)) * valid_b[:, None].to(dtype))
        row = a[:, None, None]
        f = F.silu(self.factor_input_proj(torch.cat([x, row.expand_as(x), x * row], -1)))
        out = F.normalize(self.out_head(f), dim=-1, eps=self.eps)
        inc = F.normalize(self.in_head(f), dim=-1, eps=self.eps)
        a_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.eps)
        start = (a_out[:, None] * inc[:, 0]).sum(-1)  # [b, K]
        pair = out[:, :-1] @ inc[:, 1:].transpose(-1, -2)  # [b, S-1, K, K]
        first = start[:, None, None].expand(b, 1, k, k)
        return self.scale * torch.cat([first, pair], 1).float()

    def candidates(self, unary_xv: Tensor) -> tuple[Tensor, Tensor]:
        """(log-probs, ids) [x, K] of the top-K of log_softmax(unary) over the full vocabulary."""
        return F.log_softmax(unary_xv.float(), -1).topk(self.k, -1)


def lattice_walk(scores_bskk: Tensor, pick=None) -> Tensor:
    """Candidate index [b, S] per slot: prev = 0, idx_s = pick(scores[:, s, prev]) (argmax)."""
    b = scores_bskk.shape[0]
    prev = torch.zeros(b, dtype=torch.long, device=scores_bskk.device)
    picks = []
    for s in range(scores_bskk.shape[1]):
        row = scores_bskk[torch.arange(b, device=prev.device), s, prev]
        prev = row.argmax(-1) if pick is None else pick(row)
        picks.append(prev)
    return torch.stack(picks, 1)


def anchor_rows(drafter: Any, batch: dict[str, Tensor], anchors_bn: Tensor):
    """The fused context row before each anchor [Bt, N, H] and whether it exists (a row of the
    anchor's document) [Bt, N]: the row whose target output predicted the anchor."""
    before = (anchors_bn - 1).clamp(min=0)
    feats = batch["hidden"].gather(1, before[..., None].expand(-1, -1, batch["hidden"].shape[-1]))
    valid = anchors_bn >= 1
    docs = batch.get("document_ids")
    if docs is not None:
        valid = valid & (docs.gather(1, before) == docs.gather(1, anchors_bn))
    return drafter.fuse(feats), valid


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
    ce = node.logsumexp(-1) - node_gold
    if node.shape[-1] > 1:
        rival = node.masked_fill(F.one_hot(gold, node.shape[-1]).bool(), float("-inf")).amax(-1)
        hinge = F.relu(margin - (node_gold - rival))
    else:
        hinge = torch.zeros_like(ce)
    pieces = {"ce": ce, "margin": hinge}
    if tl is not None:
        gap = F.relu(tl.gather(-1, gold[..., None]) - tl)
        pieces["pen"] = (node.softmax(-1) * gap).sum(-1)
    return sup, {key: (value * sup).sum() for key, value in pieces.items()}


class LiLiCorr(Head):
    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"
    fields = {**dict.fromkeys(REQUIRED), **dict.fromkeys(CONV)}
    module_settings = SETTINGS
    walk = "lattice walk"
    tensors = "lilicorr lattice (and conv) tensors"
    weight_fields = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
                     "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim", *CONV)
    expected_taus = False

    def validate(self, config: Any) -> None:
        """vLLM 0.34's and SGLang's refusals (new_heads.md LiLiCorr (a)), plus the layout they
        compute: DFlash slots, the full target vocabulary, unscaled logits."""
        for key in REQUIRED:
            value = getattr(config, key)
            if value is None or isinstance(value, bool):
                config._fail(key, value, "is required (no engine defaults it); set "
                             "drafter." + key)
        k = config.lilicorr_candidate_topk
        if not isinstance(k, int) or not 0 < k <= 16 or k & (k - 1):
            config._fail("lilicorr_candidate_topk", k, "must be a power of two in [1, 16] "
                         "(vLLM and SGLang's fused walk)")
        if k > config.vocab_size:
            config._fail("lilicorr_candidate_topk", k, f"must be <= vocab_size={config.vocab_size}")
        h = config.lilicorr_hidden_size
        if not isinstance(h, int) or h < 0:
            config._fail("lilicorr_hidden_size", h, "must be an integer >= 0 (0 = hidden_size)")
        for key in ("lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_factor_dim"):
            if not isinstance(getattr(config, key), int) or getattr(config, key) < 1:
                config._fail(key, getattr(config, key), "must be an integer >= 1")
        if (h or config.hidden_size) % config.lilicorr_num_heads:
            config._fail("lilicorr_num_heads", config.lilicorr_num_heads,
                         f"must divide lilicorr_hidden_size={h or config.hidden_size}")
        for key in ("lilicorr_mlp_ratio", "lilicorr_logit_scale"):
            if not getattr(config, key) > 0:
                config._fail(key, getattr(config, key), "must be a number > 0")
        if not 0 < config.lilicorr_vector_eps < 0.5:
            config._fail("lilicorr_vector_eps", config.lilicorr_vector_eps,
                         "must be in (0, 0.5) (ModelOpt)")
        self._validate_conv(config)
        for key, off in (*_SCALES_OFF.items(), ("draft_vocab_size", None),
                         ("sample_from_anchor", False)):
            if getattr(config, key) != off:
                config._fail(key, getattr(config, key), f"is not applied by the engines' "
                             f"LiLiCorr (no draft vocabulary, DFlash slots); leave it at {off}")

    def _validate_conv(self, config: Any) -> None:
        kc, g = config.conv_kernel_size, config.conv_group_size
        if (kc is None) != (g is None):
            config._fail("conv_kernel_size" if kc is None else "conv_group_size", None,
                         "conv_kernel_size and conv_group_size are set both or neither "
                         "(vLLM lilicorr.py:448-455)")
        if kc is None:
            return
        if not isinstance(kc, int) or not 1 <= kc <= config.block_size:
            config._fail("conv_kernel_size", kc, f"must be an integer in [1, block_size="
                         f"{config.block_size}]")
        if not isinstance(g, int) or g < 1 or config.hidden_size % g:
            config._fail("conv_group_size", g, f"must divide hidden_size={config.hidden_size}")

    def serving_keys(self, config: Any) -> dict[str, Any]:
        """The eight keys; the conv's two only when set (both-or-neither)."""
        return {k: getattr(config, k) for k in self.fields
                if k in REQUIRED or getattr(config, k) is not None}

    def check_read(self, fields: dict[str, Any], source: str) -> None:
        missing = [f"dflash_config.{k}" for k in REQUIRED if k not in fields]
        if missing:
            raise ValueError(f"{source}: a LiLiCorrDraftModel config needs {missing}")

    def attach(self, drafter: Any) -> None:
        drafter.lilicorr = LiLiCorrLattice(drafter.config)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """new_heads.md LiLiCorr (b): what vLLM's and SGLang's loaders place (+ the convs)."""
        with torch.device("meta"):
            lattice = LiLiCorrLattice(config)
            convs = self.layer_modules(config)
        shapes = {f"lilicorr.{n}": tuple(p.shape) for n, p in lattice.state_dict().items()}
        for i in range(config.num_hidden_layers if convs else 0):
            for name, conv in convs.items():
                shapes.update((f"layers.{i}.{name}.{n}", tuple(p.shape))
                              for n, p in conv.state_dict().items())
        return shapes

    def layer_modules(self, config: Any) -> dict[str, Any]:
        if config.conv_kernel_size is None:
            return {}
        return {name: GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                               config.conv_group_size, config.block_size)
                for name in ("attention_conv", "mlp_conv")}

    def min_slots(self, config: Any) -> int:
        """The full block: the lattice's slot embeddings are sized by the trained block, so a
        short tail block is drafted as a full one and its first drafts kept."""
        return config.block_size

    def needs_distribution(self, module: Any) -> str | None:
        return "module.head.w_pen" if module.head_settings["w_pen"] > 0 else None

    def check_training(self, config: Any, module: Any) -> None:
        weights = [module.head_settings[k] for k in ("w_ce", "w_margin", "w_pen")]
        if min(weights) < 0 or not any(weights) or module.head_settings["margin"] < 0:
            raise ValueError(f"module.head: LiLiCorr's w_ce, w_margin, w_pen {weights} must be "
                             ">= 0 and not all zero, margin >= 0 (ModelOpt)")

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """The lattice over every block's top-K (live log-probs), its three sums and count."""
        drafter, hp = module.drafter, module.head_settings
        lattice: LiLiCorrLattice = drafter.lilicorr
        p = step.hidden[:, :, 1:]  # [Bt, N, S, H]
        lp, ids = lattice.candidates(step.lm_head(p.to(step.lm_head.weight.dtype)))
        anchor, valid = anchor_rows(drafter, step.batch, step.anchors)
        emb = module.target_head.embed_tokens(ids)
        scores = lattice(emb.flatten(0, 1), lp.flatten(0, 1), p.flatten(0, 1),
                         anchor.flatten(0, 1), valid.flatten())
        tl = None
        if hp["w_pen"] > 0:
            full = F.pad(ids, (0, 0, 1, 0))  # slot 0 (the anchor) is never valid
            rows = candidate_logprobs(step.teacher, full[step.tgt.valid], step.lm_head,
                                      renormalise=False)
            tl = torch.zeros(full.shape, dtype=rows.dtype, device=rows.device)
            tl[step.tgt.valid] = rows
            tl = tl[:, :, 1:].flatten(0, 1)
        slot_ok = step.tgt.valid[:, :, 1:]
        sup, sums = lattice_losses(scores, ids.flatten(0, 1), step.tgt.labels[:, :, 1:].flatten(
            0, 1), slot_ok.all(-1).flatten(), tl, hp["margin"])
        with torch.no_grad():
            walk = lattice_walk(scores.detach())
            right = (ids.flatten(0, 1).gather(-1, walk[..., None])[..., 0]
                     == step.tgt.labels[:, :, 1:].flatten(0, 1))
            prefix = (torch.cumprod(right.long(), -1).sum(-1) * slot_ok.all(-1).flatten()).sum()
        out.head_pieces["lilicorr"] = (sums, sup.sum().float(), prefix, slot_ok.all(-1).sum())

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """w_ce, w_margin, w_pen x the mean over supervised slots (each term even at weight 0:
        every parameter stays in the graph under DDP; pen only where it is computed)."""
        sums, count, prefix, blocks = out.head_pieces["lilicorr"]
        hp = module.head_settings
        extra = (("lilicorr_selected_prefix", prefix.float() / blocks.clamp(min=1)),)
        return [Term(f"lilicorr_{key}", value, count, hp[f"w_{key}"], f"lilicorr_{key}_loss",
                     extra=extra if key == "ce" else ()) for key, value in sums.items()]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """The lattice scores [1, B-1, K, K] of the probe block (embedding rows from a fixed
        random table, the probe's slot-0 row as the anchor row)."""
        gen = torch.Generator().manual_seed(1)
        h, v = hidden_bph.shape[-1], drafter.config.vocab_size
        lattice = drafter.lilicorr
        lp, ids = lattice.candidates(unary_bpv[:, 1:])
        emb = torch.randn(v, h, generator=gen)[ids]
        return [lattice(emb, lp, hidden_bph[:, 1:].float(), hidden_bph[:, 0].float(),
                        torch.ones(1))]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any, embed_tokens: Any = None,
              context_h: Any = None) -> tuple[Any, Any]:
        """vLLM's walk: greedy, or at T > 0 under rejection q = softmax(row / T) over the K
        candidates (dense over the vocabulary, zero elsewhere)."""
        if embed_tokens is None or context_h is None:
            raise ValueError("a LiLiCorr draft needs the target's embedding table and the "
                             "context row before the anchor (embed_tokens, context_h)")
        lattice = drafter.lilicorr
        lp, ids = lattice.candidates(unary_kv)
        scores = lattice(embed_tokens(ids)[None], lp[None], hidden_kh[None], context_h[None],
                         torch.ones(1, device=lp.device))
        if not (temperature > 0 and mode == "rejection"):
            return ids.gather(-1, lattice_walk(scores)[0][:, None])[:, 0], None
        rows: list[Tensor] = []

        def pick(row_bk: Tensor) -> Tensor:
            rows.append(torch.softmax(row_bk / temperature, -1))
            return torch.multinomial(rows[-1], 1, generator=generator)[:, 0]

        tokens = ids.gather(-1, lattice_walk(scores, pick)[0][:, None])[:, 0]
        q = unary_kv.new_zeros(unary_kv.shape).float().scatter_(-1, ids, torch.cat(rows))
        return tokens, q


HEAD = register(LiLiCorr())
