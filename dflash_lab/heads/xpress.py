"""XPress (docs/design/new_heads.md, "XPress"): the DFlash 1 backbone plus a block-level refiner
whose bias over the vocabulary corrects the base logits of every slot, drafted by greedy Jacobi
passes.

Served by vLLM 0.34 only, as ``Qwen3XPressModel`` with top-level ``xpress_*`` keys
(``qwen3_xpress.py:270-285``); SGLang and z-lab do not serve it. The refiner (vLLM's names,
``xpress_head.*``): hcache = [down_h(h), down_g(mean_b h)] [.., B, 2r] over the block's B
final-normed rows (anchor row 0 included); x = in_proj([hcache, w1[prev]]); u = x + (L * tril) x
per channel over the block axis (``mix.L`` raw [r, B, B]; vLLM folds it to L * tril + I);
latent = u + mlp.down(silu(mlp.gate(u)) * mlp.up(u)); bias = w2(latent) [.., B, V].

Draft (vLLM ``jacobi_refine_greedy``, ``qwen3_xpress.py:116-215``): blk = [anchor, argmax
base[1:]]; K = ``xpress_num_passes`` times, prev = [anchor, blk[:-1]] (vLLM passes the anchor as
its own predecessor) and blk[1:] = argmax(base + bias(prev))[1:], over the base top-C of each slot
when 0 < C (``xpress_topc``). Greedy only: at T > 0 the draft is a point mass, as vLLM verifies.

Training (speculators 0.9.0 ``XPressDraftModel``): the teacher-forced pass reads prev = [am1,
block tokens[:-1]] (am1: the token before the anchor; the anchor at a document start); final
logits are ONE linear head over [z; latent] (DSpark's :class:`ConcatHead`), so the CE pass runs
unchanged on it. Objective (``metrics.py``): L(tf) + consistency_weight x mean_j L(round j) +
base_anchor_weight x L(base), round j reading prev from the stop-grad argmax of the previous round
(round 0: of the base logits). The refined terms train on the label CE: the distribution losses'
fused pass gives no gradient to w2 (as DSpark's markov_w2); the base term takes ``module.loss``.

Shape legend: Bt batch, N blocks, B block size, k drafted slots, H hidden, r rank, V vocab,
C top-C candidates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.heads.domino import _SCALES_OFF
from dflash_lab.heads.dspark import ConcatHead, markov_prev_ids
from dflash_lab.model.heads import register
from dflash_lab.train.objective import Term, dflash_loss

#: Fields and defaults: vLLM 0.34's keys and defaults (``xpress_block_size``: the block size).
DEFAULTS = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_topc": 512,
            "xpress_num_passes": 6, "xpress_block_size": None}
#: ``module.head`` settings: speculators 0.9.0's schema defaults.
SETTINGS = {"consistency_weight": 0.3, "consistency_passes": 3, "base_anchor_weight": 0.6}


class Mix(nn.Module):
    """The per-channel causal mixer: ``x + (L * tril) x`` over the block axis, L raw [r, B, B]
    (``xpress_head.mix.L``, speculators' ``mix_l``); a block of b <= B rows reads L[:, :b, :b]."""

    def __init__(self, rank: int, block: int):
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block, block))

    def forward(self, x_xbr: Tensor) -> Tensor:
        b = x_xbr.shape[-2]
        lower = self.L[:, :b, :b].tril().to(x_xbr.dtype)
        return x_xbr + torch.einsum("ckj,...jc->...kc", lower, x_xbr)


class Refiner(nn.Module):
    """The nine tensors of ``xpress_head.*`` (module docstring); init as speculators'
    (``normal(0, 0.02)``, mixer zero)."""

    owns_init = True

    def __init__(self, vocab: int, hidden: int, block: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = Mix(rank, block)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(rank, mlp_hidden, bias=False),
                                  "up_proj": nn.Linear(rank, mlp_hidden, bias=False),
                                  "down_proj": nn.Linear(mlp_hidden, rank, bias=False)})
        self.w2 = nn.Linear(rank, vocab, bias=False)

    def reset_parameters(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)
        nn.init.zeros_(self.mix.L)

    def hidden_cache(self, h_xbh: Tensor) -> Tensor:
        """[.., B, 2r]: once per block (vLLM ``hidden_cache``); g is the mean of ALL B rows."""
        h = h_xbh.to(self.down_h.weight.dtype)
        return torch.cat([self.down_h(h), self.down_g(h.mean(-2, keepdim=True)).expand(
            *h.shape[:-1], -1)], -1)

    def latent(self, prev_xb: Tensor, hcache_xbf: Tensor) -> Tensor:
        """[.., b, r] for the token before each row ``prev_xb`` [.., b] (b <= B rows)."""
        x = self.mix(self.in_proj(torch.cat([hcache_xbf, self.w1(prev_xb.clamp(min=0))], -1)))
        mlp = self.mlp
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))


@torch.no_grad()
def jacobi_walk(refiner: Refiner, hidden_bh: Tensor, base_kv: Tensor, anchor_id: int,
                passes: int, topc: int = 0) -> Tensor:
    """Greedy draft tokens [k] of one block as vLLM's ``jacobi_refine_greedy`` (module
    docstring): ``hidden_bh`` the block's B rows, ``base_kv`` the base logits of slots 1..k
    (k <= B - 1: the mixer is causal, so the first k drafts of the full walk)."""
    k, vocab = base_kv.shape
    hcache = refiner.hidden_cache(hidden_bh)[: k + 1]
    anchor = torch.tensor([anchor_id], device=base_kv.device)
    blk = torch.cat([anchor, base_kv.argmax(-1)])
    c = min(topc, vocab)
    if c:
        base_c, cand = base_kv.topk(c, dim=-1)
        w2c = refiner.w2.weight[cand]  # [k, C, r]
    for _ in range(passes):
        lat = refiner.latent(torch.cat([anchor, blk[:-1]]), hcache)[1:].to(base_kv.dtype)
        if c:
            pick = (base_c + (w2c.to(lat.dtype) @ lat[:, :, None])[..., 0]).argmax(-1)
            blk[1:] = cand.gather(1, pick[:, None])[:, 0]
        else:
            blk[1:] = (base_kv + F.linear(lat, refiner.w2.weight.to(lat.dtype))).argmax(-1)
    return blk[1:]


def am1_prev_ids(batch: dict[str, Tensor], prev_bnp: Tensor, anchors_bn: Tensor) -> Tensor:
    """``prev_bnp`` with slot 0 set to the token before the anchor (the anchor itself at a
    sequence or document start), as speculators trains (``core.py:141-148``)."""
    ids = batch["input_ids"]
    before = (anchors_bn - 1).clamp(min=0)
    am1 = ids.gather(1, before)
    start = anchors_bn == 0
    docs = batch.get("document_ids")
    if docs is not None:
        start |= docs.gather(1, before) != docs.gather(1, anchors_bn)
    prev = prev_bnp.clone()
    prev[..., 0] = torch.where(start, ids.gather(1, anchors_bn), am1)
    return prev


def _argmax(x_xf: Tensor, head: nn.Module, rows: int = 4096) -> Tensor:
    """argmax of ``head(x)`` [..] in row chunks (no [.., V] of the whole step held)."""
    flat = x_xf.reshape(-1, x_xf.shape[-1])
    out = torch.cat([head(flat[i:i + rows]).argmax(-1) for i in range(0, flat.shape[0], rows)])
    return out.view(x_xf.shape[:-1])


class XPress(DFlash1):
    name = "xpress"
    title = "XPress"
    architecture = "Qwen3XPressModel"
    fields = DEFAULTS
    top_level_keys = True  # vLLM reads xpress_* at the config.json top level
    block_rows = True  # the walk reads every row of the block (the refiner's mean, the anchor)
    module_settings = SETTINGS
    walk = "Jacobi walk"
    tensors = "xpress_head tensors"
    weight_fields = ("xpress_rank", "xpress_mlp_hidden")
    engines = ("vllm",)
    expected_taus = False  # the distribution pass reads a plain Linear head, not [W | w2]

    def validate(self, config: Any) -> None:
        """vLLM 0.34's rules (module docstring; new_heads.md XPress (a)), plus the layout it
        serves: fill-in (no sample_from_anchor), the full vocabulary, unscaled logits."""
        for key in ("xpress_rank", "xpress_mlp_hidden", "xpress_num_passes"):
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                config._fail(key, value, "must be an integer >= 1")
        topc = config.xpress_topc
        if isinstance(topc, bool) or not isinstance(topc, int) or not 0 <= topc <= \
                config.vocab_size:
            config._fail("xpress_topc", topc, f"must be an integer in [0, {config.vocab_size}] "
                         "(vLLM: 0 <= C <= vocab; 0 = exact full-vocabulary argmax)")
        block = config.xpress_block_size
        if block is None:
            config.head_options["xpress_block_size"] = config.block_size
        elif block != config.block_size:
            config._fail("xpress_block_size", block, f"must equal block_size "
                         f"({config.block_size}): vLLM's Jacobi pass runs B = 1 + steps rows")
        if config.sample_from_anchor:
            config._fail("sample_from_anchor", True, "must be false for XPress (vLLM refuses "
                         "it: the refiner serves the fill-in layout)")
        if config.draft_vocab_size is not None:
            config._fail("draft_vocab_size", config.draft_vocab_size, "must be null for XPress "
                         "(vLLM: the refiner bias is over the target vocabulary)")
        for key, off in _SCALES_OFF.items():
            if getattr(config, key) != off:
                config._fail(key, getattr(config, key), f"is not applied by vLLM's XPress "
                             f"walk; leave it at {off}")

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        drafter.xpress_head = Refiner(c.vocab_size, c.hidden_size, c.block_size,
                                      c.xpress_rank, c.xpress_mlp_hidden)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """vLLM's nine tensors (``load_weights``, ``qwen3_xpress.py:331-374``)."""
        v, h, r, m = (config.vocab_size, config.hidden_size, config.xpress_rank,
                      config.xpress_mlp_hidden)
        p = "xpress_head."
        return {p + "w1.weight": (v, r), p + "down_h.weight": (r, h), p + "down_g.weight": (r, h),
                p + "in_proj.weight": (r, 3 * r), p + "mix.L": (r, config.block_size,
                                                                 config.block_size),
                p + "mlp.gate_proj.weight": (m, r), p + "mlp.up_proj.weight": (m, r),
                p + "mlp.down_proj.weight": (r, m), p + "w2.weight": (v, r)}

    def min_slots(self, config: Any) -> int:
        """Every row of the trained block: vLLM always runs B = 1 + steps rows (the mean of
        hcache reads them all); a shorter tail keeps the first drafts."""
        return config.block_size

    def check_training(self, config: Any, module: Any) -> None:
        super().check_training(config, module)
        if not module.loss_spec.ce_only:
            raise ValueError("module.loss: an XPress drafter trains with module.loss=ce only "
                             "(the distribution losses' fused pass does not train "
                             "xpress_head.w2); set module.loss=ce")
        s = module.head_settings
        for key in ("consistency_weight", "base_anchor_weight"):
            if isinstance(s[key], bool) or not isinstance(s[key], (int, float)) or s[key] < 0:
                raise ValueError(f"module.head.{key}={s[key]!r}: must be a number >= 0")
        n = s["consistency_passes"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"module.head.consistency_passes={n!r}: must be an integer >= 0")

    def _prev(self, module: Any, step: Any) -> Tensor:
        cfg = module.drafter.config
        prev = markov_prev_ids(step.batch["input_ids"], step.token_ids, step.anchors,
                               cfg.block_size, cfg.label_shift)
        return am1_prev_ids(step.batch, prev, step.anchors)

    def head_inputs(self, module: Any, step: Any) -> None:
        """Final logits = [z; latent(prev_tf)] @ [W_lm | w2]."""
        refiner = module.drafter.xpress_head
        lat = refiner.latent(self._prev(module, step), refiner.hidden_cache(step.hidden))
        step.head_in = torch.cat([step.hidden, lat.to(step.hidden.dtype)], -1)
        step.lm_head = ConcatHead(step.lm_head, refiner.w2)

    def add_losses(self, module: Any, step: Any, out: Any) -> None:
        """L(base) and the consistency rounds' L(refined_j) (speculators' ``forward``)."""
        hp, s = module.hparams, module.head_settings
        refiner, base_head = module.drafter.xpress_head, step.lm_head
        plain = module.drafter.head(module.target_head.lm_head)
        args = (hp.gamma, hp.ce_chunk_size, None, hp.ce_chunk_bytes)
        base = dflash_loss(step.hidden, step.tgt, plain, *args, **step.weighting,
                           spec=module.loss_spec, teacher=step.teacher) \
            if s["base_anchor_weight"] else None
        rounds = []
        if s["consistency_passes"] and s["consistency_weight"]:
            hcache = refiner.hidden_cache(step.hidden)
            am1 = self._prev(module, step)[..., :1]
            pred = _argmax(step.hidden, plain)
            anchor = step.batch["input_ids"].gather(1, step.anchors)[..., None]
            for _ in range(s["consistency_passes"]):
                prev = torch.cat([am1, anchor, pred[..., 1:-1]], -1)
                x = torch.cat([step.hidden, refiner.latent(prev, hcache).to(step.hidden.dtype)],
                              -1)
                rounds.append(dflash_loss(x, step.tgt, base_head, *args, **step.weighting))
                with torch.no_grad():
                    pred = _argmax(x, base_head)
        out.head_pieces["xpress"] = (base, rounds)

    def terms(self, module: Any, out: Any, step: int) -> list[Term]:
        """base_anchor_weight x L(base) + consistency_weight / rounds x each L(round j)."""
        s = module.head_settings
        base, rounds = out.head_pieces["xpress"]
        found = [] if base is None else [Term("xpress_base", base.weighted_sum, base.weight_sum,
                                              s["base_anchor_weight"], "base_loss")]
        return found + [Term(f"xpress_round{j}", r.weighted_sum, r.weight_sum,
                             s["consistency_weight"] / len(rounds), f"consistency_loss_{j}")
                        for j, r in enumerate(rounds)]

    def probe_outputs(self, drafter: Any, hidden_bph: Any, unary_bpv: Any,
                      anchor_b: Any) -> list[Any]:
        """The refiner's bias [1, B, V] for prev = (anchor, then random ids)."""
        gen = torch.Generator().manual_seed(1)
        b = hidden_bph.shape[1]
        prev = torch.cat([anchor_b, torch.randint(0, drafter.config.vocab_size, (b - 1,),
                                                  generator=gen)])
        refiner = drafter.xpress_head
        lat = refiner.latent(prev[None], refiner.hidden_cache(hidden_bph.float()))
        return [lat, refiner.w2(lat)]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None) -> tuple[Any, Any]:
        """The Jacobi walk (``hidden_kh``: the block's B rows, ``block_rows``); q one-hot (a
        point mass) under rejection sampling at T > 0."""
        c = drafter.config
        tokens = jacobi_walk(drafter.xpress_head, hidden_kh, unary_kv, anchor_id,
                             c.xpress_num_passes, c.xpress_topc)
        point = temperature > 0 and mode == "rejection"
        return tokens, (F.one_hot(tokens, unary_kv.shape[-1]).float() if point else None)


HEAD = register(XPress())
