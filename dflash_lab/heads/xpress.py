"""XPress (docs/xpress.md; spec: docs/design/new_heads.md "XPress"): the DFlash 1 backbone plus a
block-level refiner whose bias over the vocabulary corrects every slot's base logits, drafted by
greedy Jacobi passes. Served by vLLM 0.34 only (``Qwen3XPressModel``, top-level ``xpress_*``).
Trained as speculators 0.9.0's ``XPressDraftModel``: final logits are ONE linear head over
[z; latent] (DSpark's :class:`ConcatHead`), so the CE and distribution passes run on it
unchanged (both train w2).

Shape legend: B block size, k drafted slots, H hidden, r rank, V vocab, C top-C.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lab.heads.dflash1 import DFlash1
from dflash_lab.heads.domino import refuse_unserved
from dflash_lab.heads.dspark import ConcatHead, markov_prev_ids
from dflash_lab.model.heads import register
from dflash_lab.train.objective import Term, dflash_loss

#: Fields and defaults: vLLM 0.34's keys and defaults (``xpress_block_size``: the block size).
DEFAULTS = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_topc": 512,
            "xpress_num_passes": 6, "xpress_block_size": None}
#: ``module.head`` settings: speculators 0.9.0's schema defaults.
SETTINGS = {"consistency_weight": 0.3, "consistency_passes": 3, "base_anchor_weight": 0.6}


class Refiner(nn.Module):
    """The nine tensors of ``xpress_head.*`` (docs/xpress.md, "What it is"); init as
    speculators' (``normal(0, 0.02)``, mixer zero)."""

    owns_init = True

    def __init__(self, vocab: int, hidden: int, block: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = nn.ParameterDict({"L": nn.Parameter(torch.zeros(rank, block, block))})
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(rank, mlp_hidden, bias=False),
                                  "up_proj": nn.Linear(rank, mlp_hidden, bias=False),
                                  "down_proj": nn.Linear(mlp_hidden, rank, bias=False)})
        self.w2 = nn.Linear(rank, vocab, bias=False)

    def reset_parameters(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)
        nn.init.zeros_(self.mix["L"])

    def hidden_cache(self, h_xbh: Tensor) -> Tensor:
        """[.., B, 2r]: once per block (vLLM ``hidden_cache``); g is the mean of ALL B rows."""
        h = h_xbh.to(self.down_h.weight.dtype)
        return torch.cat([self.down_h(h), self.down_g(h.mean(-2, keepdim=True)).expand(
            *h.shape[:-1], -1)], -1)

    def latent(self, prev_xb: Tensor, hcache_xbf: Tensor) -> Tensor:
        """[.., b, r] for the token before each row ``prev_xb`` [.., b] (b <= B rows): the
        mixer ``x + (L * tril) x`` per channel reads L[:, :b, :b] (it is causal)."""
        x = self.in_proj(torch.cat([hcache_xbf, self.w1(prev_xb.clamp(min=0))], -1))
        b, mlp = x.shape[-2], self.mlp
        x = x + torch.einsum("ckj,...jc->...kc", self.mix["L"][:, :b, :b].tril().to(x.dtype), x)
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))


@torch.no_grad()
def jacobi_walk(refiner: Refiner, hidden_bh: Tensor, base_kv: Tensor, anchor_id: int,
                passes: int, topc: int = 0) -> Tensor:
    """Greedy draft tokens [k] of one block as vLLM's ``jacobi_refine_greedy`` (docs/xpress.md,
    "Draft"): ``hidden_bh`` the block's B rows, ``base_kv`` the base logits of slots 1..k
    (k <= B - 1: the mixer is causal, so the first k drafts of the full walk)."""
    k, vocab = base_kv.shape
    hcache = refiner.hidden_cache(hidden_bh)[: k + 1]
    anchor = torch.tensor([anchor_id], device=base_kv.device)
    blk = torch.cat([anchor, base_kv.argmax(-1)])
    keep = None  # vLLM's top-C: the argmax runs over each slot's base top-C only
    if 0 < topc < vocab:
        keep = torch.zeros_like(base_kv, dtype=torch.bool).scatter_(
            1, base_kv.topk(topc, dim=-1).indices, True)
    for _ in range(passes):  # prev = [anchor, blk[:-1]]: the anchor is its own predecessor
        lat = refiner.latent(torch.cat([anchor, blk[:-1]]), hcache)[1:].to(base_kv.dtype)
        refined = base_kv + F.linear(lat, refiner.w2.weight.to(lat.dtype))
        blk[1:] = (refined if keep is None else refined.masked_fill(~keep, -torch.inf)).argmax(-1)
    return blk[1:]


def am1_prev_ids(batch: dict[str, Tensor], prev_bnp: Tensor, anchors_bn: Tensor) -> Tensor:
    """``prev_bnp`` with slot 0 set to the token before the anchor (the anchor itself at a
    sequence or document start), as speculators trains (``core.py:141-148``)."""
    ids, docs = batch["input_ids"], batch.get("document_ids")
    before = (anchors_bn - 1).clamp(min=0)
    start = anchors_bn == 0
    if docs is not None:
        start |= docs.gather(1, before) != docs.gather(1, anchors_bn)
    prev = prev_bnp.clone()
    prev[..., 0] = torch.where(start, ids.gather(1, anchors_bn), ids.gather(1, before))
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
    expected_taus = False  # the Jacobi walk drafts, not the teacher-forced [W | w2] head

    def validate(self, config: Any) -> None:
        """vLLM 0.34's rules (new_heads.md XPress (a)) and the layout it serves."""
        refuse_unserved(config, ("xpress_rank", "xpress_mlp_hidden", "xpress_num_passes"),
                        "vLLM")
        topc, vocab = config.xpress_topc, config.vocab_size
        if isinstance(topc, bool) or not isinstance(topc, int) or not 0 <= topc <= vocab:
            config._fail("xpress_topc", topc, f"must be an integer in [0, {vocab}] (vLLM: "
                         "0 <= C <= vocab; 0 = exact full-vocabulary argmax)")
        if config.xpress_block_size is None:
            config.head_options["xpress_block_size"] = config.block_size
        elif config.xpress_block_size != config.block_size:
            config._fail("xpress_block_size", config.xpress_block_size, f"must equal block_size "
                         f"({config.block_size}): vLLM's Jacobi pass runs B = 1 + steps rows")

    def attach(self, drafter: Any) -> None:
        c = drafter.config
        drafter.xpress_head = Refiner(c.vocab_size, c.hidden_size, c.block_size,
                                      c.xpress_rank, c.xpress_mlp_hidden)

    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """vLLM's nine tensors (``load_weights``, ``qwen3_xpress.py:331-374``)."""
        with torch.device("meta"):
            refiner = Refiner(config.vocab_size, config.hidden_size, config.block_size,
                              config.xpress_rank, config.xpress_mlp_hidden)
        return {f"xpress_head.{n}": tuple(p.shape) for n, p in refiner.named_parameters()}

    def min_slots(self, config: Any) -> int:
        """Every row of the trained block: vLLM always runs B = 1 + steps rows (the mean of
        hcache reads them all); a shorter tail keeps the first drafts."""
        return config.block_size

    def check_training(self, config: Any, module: Any) -> None:
        super().check_training(config, module)
        for key, v in module.head_settings.items():
            if isinstance(v, bool) or not isinstance(v, int if "passes" in key else (int, float)) \
                    or v < 0:
                raise ValueError(f"module.head.{key}={v!r}: must be a number >= 0 "
                                 "(consistency_passes: an integer)")

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
        refiner, refined = module.drafter.xpress_head, step.lm_head
        plain = module.drafter.head(module.target_head.lm_head)
        args = (hp.gamma, hp.ce_chunk_size, None, hp.ce_chunk_bytes)
        kw = {**step.weighting, "spec": module.loss_spec, "teacher": step.teacher}
        base = dflash_loss(step.hidden, step.tgt, plain, *args, **kw) \
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
                rounds.append(dflash_loss(x, step.tgt, refined, *args, **kw))
                with torch.no_grad():
                    pred = _argmax(x, refined)
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
        """The refiner's bias [1, B, V] for prev = (anchor, then fixed random ids)."""
        gen, refiner = torch.Generator().manual_seed(1), drafter.xpress_head
        prev = torch.randint(0, drafter.config.vocab_size, hidden_bph.shape[:2], generator=gen)
        prev[0, 0] = anchor_b[0]
        return [refiner.w2(refiner.latent(prev, refiner.hidden_cache(hidden_bph.float())))]

    def draft(self, drafter: Any, hidden_kh: Any, unary_kv: Any, anchor_id: int,
              temperature: float, mode: str, generator: Any,
              embed_tokens: Any = None, context_h: Any = None) -> tuple[Any, Any]:
        """The Jacobi walk (``hidden_kh``: the block's B rows, ``block_rows``); q one-hot (a
        point mass) under rejection sampling at T > 0."""
        c = drafter.config
        tokens = jacobi_walk(drafter.xpress_head, hidden_kh, unary_kv, anchor_id,
                             c.xpress_num_passes, c.xpress_topc)
        point = temperature > 0 and mode == "rejection"
        return tokens, (F.one_hot(tokens, unary_kv.shape[-1]).float() if point else None)


HEAD = register(XPress())
