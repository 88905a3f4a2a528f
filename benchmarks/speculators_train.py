"""speculators' side of the quality comparison (issues 20 and 27,
``python -m scripts.compare_speculators``), run with the speculators venv's interpreter
(``.venv-speculators``): it must not import dflash_lab.

Trains speculators 0.9.0's own DFlash drafter (``--variant dflash1``, the default), DFlash 2
drafter (``--variant dflash2``), DSpark drafter (``--variant dspark``) or XPress drafter
(``--variant xpress``) on the batches of
``plan.json`` (``benchmarks/peer_quality.py plan``: the samples our trainer's loader serves at
each optimizer step, and our schedule's lr at that step) and saves it with their
``save_pretrained`` every ``--save-every`` steps (``OUT/step-N/``; our importer reads those
directories, every variant).

What is theirs: the model and its construction (``create_transformer_layer_config`` and
``DFlashDraftModel.from_training_args`` / ``DFlash2DraftModel.from_training_args``, as their
``speculators.train`` CLI builds a draft from the verifier: draft layers shaped like the
verifier's, all full attention, embeddings and LM head loaded from it and frozen; DFlash 2 adds
their grouped dynamic conv around every sublayer and their candidate selector), their seeding
(``speculators.train.cli.set_seed(--seed)`` before the model is built, as their CLI; it drives
their initialisation and their anchor sampling, ``torch.randperm`` on the global generator), the
forward (their anchor sampling: ``max_anchors`` per packed batch over every loss position of the
pack; their block mask, their target projection), the loss their trainer resolves for the
variant by default (their ``TrainConfig`` defaults, :func:`their_loss`) through
``get_trainer_kwargs``, and the step of their ``Trainer.train_epoch`` (forward, zero_grad,
backward, clip_grad_norm_ 1.0, optimizer step, lr step). Batches are packed as their collator
packs them: samples concatenated into one row, ``document_ids`` per sample, ``position_ids``
restarting at 0 per sample.

Their defaults (speculators 0.9.0, ``speculators/train/config/schema.py``
``TrainConfig._resolve_derived_defaults``; ``speculators/losses``):

- DFlash 1 (``--speculator-type dflash``): loss ``ce`` (CE on the argmax of the verifier's
  logits) with ``dpace`` position weights (alpha 0.5); ``--weighting fixed-exp-decay`` gives the
  paper's exp(-(t-1)/gamma), as ours.
- DFlash 2 (``dflash2``): ``kl_div`` (KL(softmax(verifier logits) || softmax(draft logits)) over
  the vocabulary, both at temperature 1) with ``fixed-exp-decay`` position weights, plus
  ``selector_loss_alpha`` (1.0) x their K-way selector CE over the unary top-K (teacher-forced
  predecessors; the gold token = argmax of the verifier logits, swapped in for the K-th
  candidate when missing), the same position weights; their eager TV metric runs every step.
  ``--weighting dpace`` switches their loss to ``ce`` (their config refuses D-PACE without it).
- DSpark (``dspark``): ``kl_div`` on the Markov-biased logits with ``fixed-exp-decay`` position
  weights (their ``sample_from_anchor`` default true: slot k predicts anchor + k + 1), plus
  ``confidence_head_alpha`` (their ``DSparkArgs`` default 1.0, read at run time) x the BCE of
  their confidence head against 1 - TV(q, p), with the fixed decay; their Markov head's previous
  tokens are the data tokens. The heads are built at the plan's fields (ours: their
  ``DSparkSpeculatorConfig`` defaults, rank 256 vanilla); run.json records their defaults and
  any field where the plan differs (``dspark_not_default``).
- XPress (``xpress``, ``XPressDraftModel``: the DFlash backbone plus their causal refiner):
  their schema's unset ``--loss-fn`` for xpress, ``{"ce": 0.1, "tv": 0.9}`` (CE on the argmax of
  the verifier's logits plus TV to their softmax), with ``fixed-exp-decay`` position weights, on
  the teacher-forced refine pass + ``consistency_weight`` (0.3) x the mean over
  ``consistency_passes`` (3) free-running Jacobi rounds (round j reads round j - 1's stop-grad
  argmax) + ``base_anchor_weight`` (0.6) x the same loss on the backbone's own logits
  (``XPressArgs()`` of their schema, read at run time: ``ce_from_data`` false,
  ``base_anchor_full_weight`` false); their fill-in block (``sample_from_anchor`` false: slot 0
  is the anchor). ``--weighting dpace`` switches their loss to ``ce`` (their config refuses
  D-PACE without it). Forced by the plan (:func:`xpress_fields`; run.json records each one that
  differs from their defaults, ``xpress_not_default``): ``xpress_rank``, ``xpress_mlp_ratio`` =
  our ``xpress_mlp_hidden / xpress_rank``, ``num_jacobi_passes`` = our ``xpress_num_passes``
  (stored in their config only; not used in training), ``sample_from_anchor``; a plan their
  schema cannot express is refused naming the field (an ``xpress_mlp_hidden`` that is not a
  multiple of the rank; an ``xpress_topc`` other than the ``min(512, vocab)`` that our reader
  gives their checkpoints, which store no top-C). Like every variant: the layer count, block
  size (their XPress defaults: 5 layers, block 16; the SmolLM2 plan: 3 and 8), target layers,
  mask id, gamma, anchor budget, float32 and eager losses (their fused ones need Triton) are
  the plan's.
- Either way the weighted per-slot loss is summed and divided by the count of valid slots (+1e-5),
  not by the weight sum as ours.

How their trainer gets the verifier's logits: ``_backbone_forward`` computes, without gradient,
``targets = verifier_lm_head(verifier_norm(verifier_last_hidden_states[:, p - 1]))`` for every
drafted slot p: ``verifier_norm`` is the verifier's final RMSNorm (its ``model.norm.weight``,
frozen) and ``verifier_lm_head`` its LM head (``lm_head.weight``, or ``embed_tokens.weight`` for a
tied head such as SmolLM2's), both loaded from the verifier directory by their
``load_verifier_weights``. Their own data path stores as ``verifier_last_hidden_states`` the
verifier's last decoder layer output *before* the final norm (the extra layer id that vLLM's
hidden-state extraction adds with ``--include-last-layer``), which is why the norm is applied in
the trainer.

Two modes for the verifier head, chosen from the capture's manifest (``distribution``) with a log
line, or by ``--verifier-logits``:

- ``real`` (the capture holds ``target_last_hidden``: ``capture.distribution=[last_hidden]``):
  ``verifier_last_hidden_states`` = our stored ``target_last_hidden`` [T, H] (bfloat16 on disk,
  upcast to float32), ``verifier_norm`` replaced by the identity and ``verifier_lm_head`` kept as
  their loader filled it (the target's own head). Our stored state is the target's FINAL-NORMED
  last hidden state (HF ``base_model(...).last_hidden_state`` = norm(last decoder output)), so
  ``lm_head(target_last_hidden) = lm_head(norm(pre-norm state))``: exactly the logits their data
  path gives, up to where the bfloat16 rounding is applied (theirs rounds the pre-norm state,
  ours the normed one, and our capture ran the target in bfloat16). Their norm must not run
  again: a second RMSNorm gives w * norm(w * x) != w * x unless w = 1. Their ``ce`` then labels
  each slot with the argmax of these logits (float32, recomputed: it can differ from our stored
  ``target_argmax``, computed in the target's bfloat16, at near-ties; run.json records how often
  on the first batch), their DFlash 2 ``kl_div`` distils the full distribution.
- ``point-mass`` (argmax-only captures: issue 20's runs): the verifier head gives point-mass
  logits at the stored ``target_argmax`` (:class:`OneHotVerifierHead`). Their ``ce`` takes the
  argmax of those, exactly the label ours trains on; their softmax of them is exactly one-hot in
  float32, so their DFlash 2 ``kl_div`` is exactly the CE on that label (KL(one-hot || q) =
  -log q(label)): with such a capture their default cannot distil the distribution, and the TV
  and candidate-mass metrics see a point mass.

What is matched to ours: the batches (same samples, same order, same steps, whatever the seed),
the anchor budget (``num_anchors_per_sequence x sequences`` per packed batch), gamma, the DFlash 2
conv and selector shape (the plan's drafter: our conf/drafter/dflash2.yaml, which are also their
defaults), float32 (their trainer autocasts to bfloat16 on GPU). The seed is the comparison's
(``--seed``, default 0; their CLI's default is 42).

The optimizer (``--optimizer``):

- ``default`` (the default): their trainer's own, at their CLI's unmodified defaults
  (speculators 0.9.0 ``OptimizerArgs`` / ``SchedulerArgs``, read from their schema at run time):
  their ``build_optimizers`` (Muon on the 2-D weight matrices with ``match_rms_adamw``, AdamW on
  the rest, lr 1e-3 for both groups, weight decay 0.1 / 0.01) and one linear schedule per
  optimizer with their warmup of 1% of the steps (their ``_resolve_scheduler_steps`` with
  ``max_steps`` = the plan's steps, as ``--max-steps`` gives it), stepped after every optimizer
  step as their ``Trainer.train_epoch`` steps it.
- ``plan``: the controlled setting of the earlier runs: AdamW with our lr, betas and weight decay,
  and the lr of our schedule at every step (the plan's), so that only model, loss and weighting
  differ.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open

#: The stored argmax's logit in :class:`OneHotVerifierHead` (every other logit is 0): far enough
#: that float32's softmax is exactly one-hot (exp(-1e4) underflows to 0), finite so nothing
#: downstream meets inf - inf.
POINT_MASS_LOGIT = 1.0e4

#: Their DFlash 2 conv and selector fields, as the plan's drafter names them (ours and theirs
#: use the same names).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

#: ``--optimizer``: ``default`` is their trainer's own at their defaults, ``plan`` our AdamW.
OPTIMIZERS = ("default", "plan")

#: ``--verifier-logits``: ``auto`` picks ``real`` when the capture holds ``target_last_hidden``.
VERIFIER_LOGITS = ("auto", "real", "point-mass")

#: Below this share of first-batch loss positions where argmax(lm_head(target_last_hidden))
#: equals the stored ``target_argmax``, the head and the states do not belong together (another
#: target's head, or states stored before the final norm): bfloat16 near-ties move a few
#: percent, never half.
MIN_ARGMAX_AGREEMENT = 0.5

#: Positions per chunk of :func:`argmax_agreement` (bounds the [rows, V] float32 logits).
AGREEMENT_CHUNK = 256


class OneHotVerifierHead(torch.nn.Module):
    """``[..., 1]`` float token ids (the stored target argmax) -> ``[..., V]`` point-mass logits
    (``POINT_MASS_LOGIT`` at the id, 0 elsewhere): their ``ce`` loss and accuracy take the argmax
    of the verifier logits, which is then the stored id, and their ``kl_div`` (DFlash 2's default)
    the softmax, which is then exactly the one-hot of it."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        one_hot = torch.nn.functional.one_hot(ids[..., 0].long(), self.vocab_size).float()
        return one_hot * POINT_MASS_LOGIT


#: Their schema's unset ``--loss-fn`` per speculator type (``_DEFAULT_LOSS_FN`` of speculators
#: 0.9.0 ``train/config/schema.py``; :func:`their_xpress_defaults` checks it at run time).
THEIR_DEFAULT_LOSS = {"dflash": "ce", "xpress": '{"ce": 0.1, "tv": 0.9}'}


def their_loss(variant: str, weighting: str | None) -> tuple[str, str]:
    """(loss_fn, per_position_loss_weight) as their ``TrainConfig`` resolves them for
    ``--speculator-type VARIANT`` with ``--per-position-loss-weight WEIGHTING`` (None: unset)
    and ``--loss-fn`` unset: weighting dpace for dflash, fixed-exp-decay otherwise; loss ce for
    dflash, ``{"ce": 0.1, "tv": 0.9}`` for xpress, kl_div otherwise, except that their config
    refuses dpace without ce (so dflash2 with dpace trains ce, what ``--loss-fn ce`` would
    give)."""
    kind = "dflash" if variant == "dflash1" else variant
    weighting = weighting or ("dpace" if kind == "dflash" else "fixed-exp-decay")
    loss_fn = "ce" if weighting == "dpace" else THEIR_DEFAULT_LOSS.get(kind, "kl_div")
    return loss_fn, weighting


def _plan_drafter(plan: dict, variant: str, name: str) -> dict:
    """The plan's drafter section; ValueError when it is not a ``variant`` drafter's (``name``:
    how the message names our overrides), since ours and theirs must be the same shape."""
    d = plan["drafter"]
    found = d.get("variant", "dflash1")
    if found != variant:
        raise ValueError(f"--variant {variant} but the plan's drafter is {found!r}: write the "
                         f"plan with our {name} overrides "
                         f"(python -m scripts.compare_speculators stages=[plan] variant={variant})")
    return d


def dflash2_fields(plan: dict) -> dict[str, int]:
    """The plan drafter's conv and selector fields; ValueError when the plan is a DFlash 1
    drafter's (ours and theirs must be the same shape)."""
    d = _plan_drafter(plan, "dflash2", "DFlash 2")
    return {k: int(d[k]) for k in DFLASH2_FIELDS}


def capture_distribution(capture: str | Path) -> dict:
    """What of the target distribution the capture holds, from its ``manifest.json``:
    ``{"last_hidden": bool, "topk": k}`` (captures from before ``capture.distribution``: neither).
    The same reading as ``dflash_lab.data.shards.distribution_of`` (not imported: this file runs
    in the speculators venv)."""
    path = Path(capture) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: the plan's capture directory must hold a "
                                "finished dflash-capture "
                                "(python -m scripts.compare_speculators stages=[capture])")
    found = json.loads(path.read_text()).get("distribution") or {}
    return {"last_hidden": bool(found.get("last_hidden", False)),
            "topk": int(found.get("topk", 0))}


def verifier_mode(capture: str | Path, requested: str = "auto") -> str:
    """``real`` or ``point-mass`` for the capture (``requested``: one of
    :data:`VERIFIER_LOGITS`); prints the log line saying which and why. ``real`` on a capture
    without ``target_last_hidden`` is a ValueError naming the capture option."""
    if requested not in VERIFIER_LOGITS:
        raise ValueError(f"--verifier-logits={requested!r}: expected one of {VERIFIER_LOGITS}")
    held = capture_distribution(capture)["last_hidden"]
    if requested == "real" and not held:
        raise ValueError(f"--verifier-logits real: the capture {capture} holds no "
                         "target_last_hidden; recapture with capture.distribution=[last_hidden] "
                         "(python -m scripts.compare_speculators stages=[capture] "
                         "distribution=last_hidden)")
    mode = requested if requested != "auto" else ("real" if held else "point-mass")
    if mode == "real":
        print(f"verifier logits: real, their verifier_lm_head (the target's own head) on the "
              f"captured final-normed target_last_hidden of {capture}; their verifier_norm is "
              "the identity (the state is normed already)", flush=True)
    else:
        why = ("--verifier-logits point-mass" if requested == "point-mass" else
               "it holds no target_last_hidden (capture.distribution=[last_hidden] adds it)")
        print(f"verifier logits: point mass at the stored target_argmax of {capture}: {why}; "
              "their kl_div is then the CE on that argmax", flush=True)
    return mode


#: Their DSpark head fields, as the plan's drafter names them (ours and theirs use the same
#: names); ``sample_from_anchor`` is their DFlash-family field (DSpark default: true).
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov", "sample_from_anchor")


def dspark_fields(plan: dict) -> dict:
    """The plan drafter's Markov, confidence and ``sample_from_anchor`` fields; ValueError when
    the plan is not a DSpark drafter's (ours and theirs must be the same shape)."""
    d = _plan_drafter(plan, "dspark", "DSpark")
    return {k: d[k] for k in DSPARK_FIELDS}


def their_dspark_defaults() -> dict:
    """Their CLI's DSpark defaults (``DSparkArgs()`` of their schema: the Markov and confidence
    heads and ``confidence_head_alpha``) and their DSpark ``sample_from_anchor`` default (true:
    ``DFlashArgs.sample_from_anchor`` unset resolves to true for dspark in
    ``_build_base_config_kwargs``)."""
    from speculators.train.config.schema import DFlashArgs, DSparkArgs

    found = DSparkArgs().model_dump()
    unset = DFlashArgs().sample_from_anchor
    return {**found, "sample_from_anchor": True if unset is None else unset}


#: The top-C our reader gives a speculators XPress checkpoint (they store none:
#: export/formats/speculators.py, ``min(XPRESS_READ_TOPC, vocab)``; vLLM's default).
XPRESS_READ_TOPC = 512


def xpress_fields(plan: dict) -> dict:
    """Their ``XPressDraftModel.from_training_args`` refiner kwargs for the plan drafter's
    XPress fields (module docstring); ValueError naming the field when the plan is not an XPress
    drafter's or has a field their schema cannot express."""
    d = _plan_drafter(plan, "xpress", "XPress")
    rank, hidden, vocab = int(d["xpress_rank"]), int(d["xpress_mlp_hidden"]), d["vocab_size"]
    if hidden % rank:
        raise ValueError(f"the plan's drafter has xpress_mlp_hidden={hidden}, not a multiple of "
                         f"xpress_rank={rank}: their refiner's MLP hidden is rank x "
                         "xpress_mlp_ratio (an integer); write the plan with "
                         f"drafter.xpress_mlp_hidden={2 * rank} (their ratio 2)")
    if d["xpress_topc"] != min(XPRESS_READ_TOPC, vocab):
        raise ValueError(f"the plan's drafter has xpress_topc={d['xpress_topc']}: their XPress "
                         "checkpoints store no top-C and our reader gives them "
                         f"{min(XPRESS_READ_TOPC, vocab)} (min(512, vocab)), so both sides "
                         "would not draft alike; write the plan with drafter.xpress_topc="
                         f"{min(XPRESS_READ_TOPC, vocab)}")
    return {"xpress_rank": rank, "xpress_mlp_ratio": hidden // rank,
            "num_jacobi_passes": int(d["xpress_num_passes"]),
            "sample_from_anchor": bool(d.get("sample_from_anchor", False))}


def their_xpress_defaults() -> dict:
    """Their CLI's XPress defaults (``XPressArgs()`` of their schema: refiner shape, consistency
    rounds, base anchor), their unset ``sample_from_anchor`` for xpress (false) and their unset
    ``--loss-fn`` (checked equal to :data:`THEIR_DEFAULT_LOSS`)."""
    from speculators.models.xpress import XPressSpeculatorConfig
    from speculators.train.config.schema import _DEFAULT_LOSS_FN, XPressArgs

    loss = _DEFAULT_LOSS_FN.get("xpress")
    if loss != THEIR_DEFAULT_LOSS["xpress"]:  # 0.9.0's; another release needs a look
        raise ValueError(f"speculators' default xpress loss is {loss!r}, this harness knows "
                         f"{THEIR_DEFAULT_LOSS['xpress']!r} (speculators 0.9.0; "
                         "make speculators-venv installs it)")
    sample = XPressSpeculatorConfig.model_fields["sample_from_anchor"].default
    return {**XPressArgs().model_dump(), "sample_from_anchor": sample, "loss_fn": loss}


def their_model(target: str, plan: dict, seed: int, variant: str = "dflash1"):
    """speculators' DFlash (``variant`` dflash1), DFlash 2, DSpark or XPress drafter for the
    verifier at ``target`` exactly as their CLI builds one (their ``set_seed(seed)`` first; all
    layers full attention), shaped by the plan's drafter (the head's fields too), their
    ``verifier_norm`` and ``verifier_lm_head`` as their loader filled them."""
    from speculators.train.cli import create_transformer_layer_config, set_seed

    if variant == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as model_cls

        extra = dflash2_fields(plan)
    elif variant == "dspark":
        from speculators.models.dspark import DSparkDraftModel as model_cls

        extra = dspark_fields(plan)
    elif variant == "xpress":
        from speculators.models.xpress import XPressDraftModel as model_cls

        extra = xpress_fields(plan)
    else:
        from speculators.models.dflash import DFlashDraftModel as model_cls

        extra = {}
    d = plan["drafter"]
    n = d["num_hidden_layers"]
    layer_cfg = create_transformer_layer_config(
        target, num_layers=n, draft_arch="qwen3", hidden_act=None, sliding_window=2048,
        full_attention_indices=list(range(n)))
    set_seed(seed)
    return model_cls.from_training_args(
        verifier_config=layer_cfg, verifier_name_or_path=target,
        draft_vocab_size=d["vocab_size"], block_size=d["block_size"],
        # speculators' aux ids index HF hidden_states: ours (decoder-layer outputs) + 1
        target_layer_ids=[i + 1 for i in d["target_layer_ids"]],
        mask_token_id=d["mask_token_id"], draft_attn_impl="sdpa", **extra)


def build_model(target: str, plan: dict, seed: int, variant: str = "dflash1",
                logits: str = "point-mass"):
    """:func:`their_model` with the verifier head of mode ``logits`` (module docstring):
    ``verifier_norm`` the identity either way; ``real`` keeps their ``verifier_lm_head`` (checked
    [vocab, hidden] as the plan's drafter and finite, i.e. loaded), ``point-mass`` replaces it by
    :class:`OneHotVerifierHead`."""
    model = their_model(target, plan, seed, variant)
    d = plan["drafter"]
    model.verifier_norm = torch.nn.Identity()
    if logits == "real":
        w = model.verifier_lm_head.weight
        want = (d["vocab_size"], d["hidden_size"])
        if tuple(w.shape) != want or not torch.isfinite(w).all():
            raise ValueError(f"their verifier_lm_head from {target} is {tuple(w.shape)} "
                             f"(finite: {bool(torch.isfinite(w).all())}), the plan's drafter "
                             f"needs [vocab, hidden] = {list(want)}: --target must be the "
                             "capture's target directory")
    else:
        model.verifier_lm_head = OneHotVerifierHead(d["vocab_size"])
    return model


@torch.no_grad()
def argmax_agreement(lm_head: torch.nn.Module, last_hidden: torch.Tensor,
                     argmax: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """How often argmax(lm_head(last_hidden)) [T] equals the stored ``argmax`` [T] on the loss
    positions (``loss_mask`` [T]), in chunks of :data:`AGREEMENT_CHUNK` positions:
    ``{"agree": n, "positions": m, "fraction": n / m}``."""
    rows = loss_mask.bool().nonzero()[:, 0]
    agree = 0
    for start in range(0, rows.numel(), AGREEMENT_CHUNK):
        r = rows[start:start + AGREEMENT_CHUNK]
        agree += int((lm_head(last_hidden[r].float()).argmax(-1) == argmax[r].long()).sum())
    m = int(rows.numel())
    return {"agree": agree, "positions": m, "fraction": agree / m if m else None}


def check_agreement(found: dict, capture: str | Path, target: str) -> None:
    """ValueError when the first batch's :func:`argmax_agreement` is below
    :data:`MIN_ARGMAX_AGREEMENT` (the head and the stored states do not belong together)."""
    if found["fraction"] is not None and found["fraction"] < MIN_ARGMAX_AGREEMENT:
        raise ValueError(
            f"argmax(lm_head(target_last_hidden)) equals the stored target_argmax on only "
            f"{found['agree']}/{found['positions']} loss positions of the first batch of "
            f"{capture}: the head of {target} and these states do not belong together (another "
            "target, or states stored before the final norm); pass the capture's own --target")


def trainer_kwargs(model, plan: dict, loss_fn: str, weighting: str,
                   head_defaults: dict | None = None) -> dict:
    """The forward kwargs their trainer passes every step (``get_trainer_kwargs`` of the model's
    class, eager losses: their fused ones need Triton). ``head_defaults``: their schema's
    defaults of the head's group (DSpark's ``confidence_head_alpha``, XPress's consistency and
    anchor knobs), passed as their CLI passes every argument; each class reads its own."""
    head = {k: v for k, v in (head_defaults or {}).items() if k != "loss_fn"}
    return type(model).get_trainer_kwargs(**{
        **head, "loss_fn": loss_fn, "loss_implementation": "eager",
        "dflash_decay_gamma": plan["gamma"],
        "max_anchors": plan["num_anchors_per_sequence"] * plan["batch_size"],
        "per_position_loss_weight": weighting, "dpace_alpha": 0.5,
        "selector_loss_alpha": 1.0})[0]  # their DFlash2Args default (the others ignore it)


#: Per-sample tensors read from a shard; ``target_last_hidden`` is added in real-logits mode.
SAMPLE_KEYS = ("input_ids", "loss_mask", "target_argmax", "hidden")


class Shards:
    """Rows of the capture's shards (safetensors, opened once each); ``keys``: the tensors to
    read (``target_last_hidden`` too in real-logits mode)."""

    def __init__(self, root: str | Path, keys: tuple[str, ...] = SAMPLE_KEYS):
        self.root, self.keys, self.handles = Path(root), keys, {}

    def sample(self, file: str, a: int, b: int) -> dict[str, torch.Tensor]:
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.root / file), framework="pt")
        f = self.handles[file]
        held = set(f.keys())
        missing = [k for k in self.keys if k not in held]
        if missing:
            raise ValueError(f"{self.root / file} has no {missing}: the manifest promises them; "
                             "recapture that directory")
        return {k: f.get_slice(k)[a:b] for k in self.keys}


def their_default_optimizer_args() -> dict:
    """Their CLI's optimizer and scheduler defaults (``OptimizerArgs()`` and ``SchedulerArgs()``
    of their schema, unset ``muon_lr`` resolved to ``lr`` as their ``TrainConfig`` does)."""
    from speculators.train.config.schema import OptimizerArgs, SchedulerArgs

    args = {**OptimizerArgs().model_dump(), **SchedulerArgs().model_dump()}
    if args["muon_lr"] is None:
        args["muon_lr"] = args["lr"]
    return args


def build_optimizer(model, plan: dict, which: str):
    """(optimizers, schedulers, record) for ``--optimizer`` (module docstring). ``plan``: one
    AdamW at our settings and no scheduler (the loop sets each step's lr from the plan);
    ``default``: their ``build_optimizers`` and one schedule per optimizer, as their
    ``Trainer.setup_optimizer`` builds them, over ``plan["num_steps"]`` steps."""
    if which == "plan":
        o = plan["optimizer"]
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]),
                                weight_decay=o["weight_decay"])
        return [opt], [], {"name": "plan", "adamw": o}
    from types import SimpleNamespace

    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import (
        _resolve_scheduler_steps,
        get_linear_schedule_with_warmup,
    )

    args = their_default_optimizer_args()
    if args["scheduler_type"] != "linear":  # 0.9.0's default; another release needs a look
        raise ValueError(f"speculators' default scheduler_type is {args['scheduler_type']!r}: "
                         "this harness reproduces their linear default only (speculators 0.9.0; "
                         "make speculators-venv installs it)")
    cfg = SimpleNamespace(**args, num_epochs=1, max_steps=plan["num_steps"])
    opts = build_optimizers(model, cfg)
    warmup, total = _resolve_scheduler_steps(cfg, plan["num_steps"])
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup,
                                              num_training_steps=total) for o in opts]
    names = [type(o).__name__ for o in opts]
    return opts, scheds, {"name": "default", "optimizers": names, "warmup_steps": warmup,
                          "total_steps": total, **args}


def pack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Their collator's layout: one row [1, T] of the samples back to back.

    ``verifier_last_hidden_states``: with ``target_last_hidden`` in the samples (real-logits
    mode) that state [1, T, H] in float32, else the stored argmax as [1, T, 1] floats for
    :class:`OneHotVerifierHead`."""
    cat = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    verifier = (cat["target_last_hidden"].float()[None] if "target_last_hidden" in cat
                else cat["target_argmax"].float()[None, :, None])
    return {
        "hidden_states": cat["hidden"].float()[None],
        "input_ids": cat["input_ids"].long()[None],
        "loss_mask": cat["loss_mask"].long()[None],
        "verifier_last_hidden_states": verifier,
        "document_ids": torch.repeat_interleave(torch.arange(len(samples)), lengths)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
    }


def save(model, out: Path, step: int, write=None) -> None:
    """``out/step-N`` written by ``write(tmp_dir)`` (default: their ``save_pretrained``) into a
    temporary name, then renamed (benchmarks/modelopt_train.py passes ModelOpt's exporter)."""
    final = out / f"step-{step}"
    tmp = out / f".step-{step}.tmp"
    (write or model.save_pretrained)(str(tmp))
    os.replace(tmp, final)


def bridge_args(doc: str, variants: list[str], argv: list[str] | None) -> argparse.Namespace:
    """The arguments every other peer's bridge takes (benchmarks/modelopt_train.py,
    benchmarks/specforge_train.py): ``--plan --target --out --save-every --variant --seed``
    (``variants``: the choices, the first the default; ``doc``: the module docstring)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--target", required=True, help="the capture's target directory (HF)")
    p.add_argument("--out", required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--variant", default=variants[0], choices=variants)
    p.add_argument("--seed", type=int, default=0, help="their set_seed: init and anchors")
    return p.parse_args(argv)


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as indented JSON at ``path`` (a temporary name, then renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--target", required=True, help="the verifier directory (HF)")
    p.add_argument("--out", required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--variant", default="dflash1",
                   choices=["dflash1", "dflash2", "dspark", "xpress"])
    p.add_argument("--weighting", default=None, choices=["dpace", "fixed-exp-decay"],
                   help="position weights (default: theirs for the variant, dpace for dflash1, "
                        "fixed-exp-decay for the others)")
    p.add_argument("--seed", type=int, default=0,
                   help="their set_seed before the model is built: init and anchor sampling")
    p.add_argument("--optimizer", default="default", choices=list(OPTIMIZERS),
                   help="default: their trainer's optimizer and schedule at their CLI's defaults "
                        "(Muon + AdamW, lr 1e-3, linear with 1%% warmup); plan: our AdamW and "
                        "the plan's lr at every step")
    p.add_argument("--verifier-logits", default="auto", choices=list(VERIFIER_LOGITS),
                   help="auto: real when the capture holds target_last_hidden, else point-mass")
    a = p.parse_args(argv)
    plan = json.loads(Path(a.plan).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    loss_fn, weighting = their_loss(a.variant, a.weighting)
    mode = verifier_mode(plan["capture"], a.verifier_logits)

    model = build_model(a.target, plan, a.seed, a.variant, mode)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opts, scheds, opt_info = build_optimizer(model, plan, a.optimizer)
    defaults, fields = {"dspark": (their_dspark_defaults, dspark_fields),
                        "xpress": (their_xpress_defaults, xpress_fields)}.get(
        a.variant, (dict, None))
    head = defaults()
    kwargs = trainer_kwargs(model, plan, loss_fn, weighting, head)
    shards = Shards(plan["capture"], SAMPLE_KEYS + (("target_last_hidden",) if mode == "real"
                                                    else ()))
    info = {"variant": a.variant, "trainable_params": sum(q.numel() for q in params),
            "loss_fn": loss_fn, "weighting": weighting, "max_anchors": kwargs["max_anchors"],
            "steps": plan["num_steps"], "seed": a.seed, "verifier_logits": mode,
            "ours_trainable_params": plan["drafter"]["trainable_params"], "optimizer": opt_info}
    if fields:  # their heads at the plan's fields: say where those differ from their defaults
        info[f"{a.variant}_defaults"] = head
        info[f"{a.variant}_not_default"] = {k: v for k, v in fields(plan).items()
                                            if head.get(k) != v}
    if mode == "real":  # before any step: a mismatched head must not train anything
        first = [shards.sample(*r) for r in plan["steps"][0]["rows"]]
        cat = {k: torch.cat([s[k] for s in first]) for k in first[0]}
        info["argmax_agreement"] = argmax_agreement(
            model.verifier_lm_head, cat["target_last_hidden"], cat["target_argmax"],
            cat["loss_mask"])
        check_agreement(info["argmax_agreement"], plan["capture"], a.target)
    print(json.dumps(info), flush=True)
    write_json(out / "run.json", info)
    with open(out / "train_log.tsv", "w") as log:  # a rerun trains from step 0 again
        t0 = time.time()
        for step, entry in enumerate(plan["steps"]):
            batch = pack([shards.sample(*r) for r in entry["rows"]])
            if not scheds:  # --optimizer plan: the lr of this step in our schedule
                for g in opts[0].param_groups:
                    g["lr"] = entry["lr"]
            lr = opts[0].param_groups[0]["lr"]
            _, loss, metrics = model(**batch, **kwargs)
            for o in opts:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan["gradient_clip_val"])
            for o in opts:
                o.step()
            for sc in scheds:
                sc.step()
            done = step + 1
            seconds = time.time() - t0
            log.write(f"{done}\t{float(loss.detach()):.5f}\t{lr:.3e}\t{seconds:.1f}\n")
            log.flush()
            if done % 10 == 0:
                print(f"step {done}/{plan['num_steps']} loss {float(loss.detach()):.4f} "
                      f"{(time.time() - t0) / done:.2f} s/step", flush=True)
            if done % a.save_every == 0 or done == plan["num_steps"]:
                save(model, out, done)


if __name__ == "__main__":
    main()
