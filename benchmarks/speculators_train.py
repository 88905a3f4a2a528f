"""speculators' side of the quality comparison (issue 20, ``scripts/compare_speculators.sh``),
run with the speculators venv's interpreter (``.venv-speculators``): it must not import
dflash_lab.

Trains speculators 0.9.0's own DFlash drafter (``--variant dflash1``, the default) or DFlash 2
drafter (``--variant dflash2``) on the batches of ``plan.json`` (``benchmarks/peer_quality.py
plan``: the samples our trainer's loader serves at each optimizer step, and our schedule's lr at
that step) and saves it with their ``save_pretrained`` every ``--save-every`` steps
(``OUT/step-N/``; our importer reads those directories, both variants).

What is theirs: the model and its construction (``create_transformer_layer_config`` and
``DFlashDraftModel.from_training_args`` / ``DFlash2DraftModel.from_training_args``, as their
``speculators.train`` CLI builds a draft from the verifier: draft layers shaped like the
verifier's, all full attention, embeddings and LM head loaded from it and frozen; DFlash 2 adds
their grouped dynamic conv around every sublayer and their candidate selector), the forward
(their anchor sampling: ``max_anchors`` per packed batch over every loss position of the pack;
their block mask, their target projection), the loss their trainer resolves for the variant by
default (their ``TrainConfig`` defaults, :func:`their_loss`) through ``get_trainer_kwargs``, and
the step of their ``Trainer.train_epoch`` (forward, zero_grad, backward, clip_grad_norm_ 1.0,
optimizer step, lr step). Batches are packed as their collator packs them: samples concatenated
into one row, ``document_ids`` per sample, ``position_ids`` restarting at 0 per sample.

Their default losses:

- DFlash 1: ``ce`` (CE on the argmax of the verifier's logits) with ``dpace`` position weights;
  ``--weighting fixed-exp-decay`` gives the paper's exp(-(t-1)/gamma), as ours.
- DFlash 2: ``kl_div`` (KL from the verifier's softmax to the draft's, over the vocabulary) with
  ``fixed-exp-decay`` position weights, plus ``selector_loss_alpha`` (1.0) x their K-way selector
  CE over the unary top-K (teacher-forced predecessors; a gold token outside the top-K replaces
  the K-th candidate), the same position weights; their eager TV metric runs every step.
  ``--weighting dpace`` switches their loss to ``ce`` (their config refuses D-PACE without it).

What is matched to ours: the batches (same samples, same order, same steps), the anchor budget
(``num_anchors_per_sequence x sequences`` per packed batch), gamma, the DFlash 2 conv and selector
shape (the plan's drafter: our conf/drafter/dflash2.yaml, which are also their defaults), AdamW
with our lr, betas and weight decay, the lr of every step, float32 (their trainer autocasts to
bfloat16 on GPU). The labels: our capture stores the target's argmax, not its last hidden state
or logits, so the verifier projection is replaced by point-mass logits of the stored argmax
(``OneHotVerifierHead``). Their ``ce`` takes the argmax of those, exactly the label ours trains
on. Their softmax of them is exactly one-hot in float32, so their DFlash 2 ``kl_div`` is exactly
the CE on that label (KL(one-hot || q) = -log q(label)): with this capture their DFlash 2 learns
from hard labels. The distillation of the target's full distribution their default would do
with real verifier states is not reproducible from it, and the TV and candidate-mass metrics see
a point mass.
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


def their_loss(variant: str, weighting: str | None) -> tuple[str, str]:
    """(loss_fn, per_position_loss_weight) as their ``TrainConfig`` resolves them for
    ``--speculator-type VARIANT`` with ``--per-position-loss-weight WEIGHTING`` (None: unset)
    and ``--loss-fn`` unset: weighting dpace for dflash, fixed-exp-decay otherwise; loss ce for
    dflash, kl_div otherwise, except that their config refuses dpace without ce (so dflash2 with
    dpace trains ce, what ``--loss-fn ce`` would give)."""
    kind = "dflash" if variant == "dflash1" else variant
    weighting = weighting or ("dpace" if kind == "dflash" else "fixed-exp-decay")
    loss_fn = "ce" if kind == "dflash" or weighting == "dpace" else "kl_div"
    return loss_fn, weighting


def dflash2_fields(plan: dict) -> dict[str, int]:
    """The plan drafter's conv and selector fields; ValueError when the plan is a DFlash 1
    drafter's (ours and theirs must be the same shape)."""
    d = plan["drafter"]
    variant = d.get("variant", "dflash1")
    if variant != "dflash2":
        raise ValueError(f"--variant dflash2 but the plan's drafter is {variant!r}: write the "
                         "plan with our DFlash 2 overrides "
                         "(VARIANT=dflash2 scripts/compare_speculators.sh plan)")
    return {k: int(d[k]) for k in DFLASH2_FIELDS}


def build_model(target: str, plan: dict, seed: int, variant: str = "dflash1"):
    """speculators' DFlash (``variant`` dflash1) or DFlash 2 drafter for the verifier at
    ``target``, built as their CLI builds one (all layers full attention), shaped by the plan's
    drafter (DFlash 2: its conv and selector fields too)."""
    from speculators.train.cli import create_transformer_layer_config

    if variant == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as model_cls

        extra = dflash2_fields(plan)
    else:
        from speculators.models.dflash import DFlashDraftModel as model_cls

        extra = {}
    d = plan["drafter"]
    n = d["num_hidden_layers"]
    layer_cfg = create_transformer_layer_config(
        target, num_layers=n, draft_arch="qwen3", hidden_act=None, sliding_window=2048,
        full_attention_indices=list(range(n)))
    torch.manual_seed(seed)
    model = model_cls.from_training_args(
        verifier_config=layer_cfg, verifier_name_or_path=target,
        draft_vocab_size=d["vocab_size"], block_size=d["block_size"],
        # speculators' aux ids index HF hidden_states: ours (decoder-layer outputs) + 1
        target_layer_ids=[i + 1 for i in d["target_layer_ids"]],
        mask_token_id=d["mask_token_id"], draft_attn_impl="sdpa", **extra)
    model.verifier_norm = torch.nn.Identity()
    model.verifier_lm_head = OneHotVerifierHead(d["vocab_size"])
    return model


def trainer_kwargs(model, plan: dict, loss_fn: str, weighting: str) -> dict:
    """The forward kwargs their trainer passes every step (``get_trainer_kwargs`` of the model's
    class, eager losses: their fused ones need Triton)."""
    return type(model).get_trainer_kwargs(
        loss_fn=loss_fn, loss_implementation="eager", dflash_decay_gamma=plan["gamma"],
        max_anchors=plan["num_anchors_per_sequence"] * plan["batch_size"],
        per_position_loss_weight=weighting, dpace_alpha=0.5,
        selector_loss_alpha=1.0)[0]  # their DFlash2Args default (DFlash 1 ignores it)


class Shards:
    """Rows of the capture's shards (safetensors, opened once each)."""

    def __init__(self, root: str | Path):
        self.root, self.handles = Path(root), {}

    def sample(self, file: str, a: int, b: int) -> dict[str, torch.Tensor]:
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.root / file), framework="pt")
        f = self.handles[file]
        return {k: f.get_slice(k)[a:b] for k in ("input_ids", "loss_mask", "target_argmax",
                                                   "hidden")}


def pack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Their collator's layout: one row [1, T] of the samples back to back."""
    cat = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    return {
        "hidden_states": cat["hidden"].float()[None],
        "input_ids": cat["input_ids"].long()[None],
        "loss_mask": cat["loss_mask"].long()[None],
        "verifier_last_hidden_states": cat["target_argmax"].float()[None, :, None],
        "document_ids": torch.repeat_interleave(torch.arange(len(samples)), lengths)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
    }


def save(model, out: Path, step: int) -> None:
    """``save_pretrained`` into ``out/step-N`` (written to a temporary name, then renamed)."""
    final = out / f"step-{step}"
    tmp = out / f".step-{step}.tmp"
    model.save_pretrained(str(tmp))
    os.replace(tmp, final)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--target", required=True, help="the verifier directory (HF)")
    p.add_argument("--out", required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--variant", default="dflash1", choices=["dflash1", "dflash2"])
    p.add_argument("--weighting", default=None, choices=["dpace", "fixed-exp-decay"],
                   help="position weights (default: theirs for the variant, dpace for dflash1, "
                        "fixed-exp-decay for dflash2)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    plan = json.loads(Path(a.plan).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    loss_fn, weighting = their_loss(a.variant, a.weighting)

    model = build_model(a.target, plan, a.seed, a.variant)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    o = plan["optimizer"]
    opt = torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]),
                            weight_decay=o["weight_decay"])
    kwargs = trainer_kwargs(model, plan, loss_fn, weighting)
    info = {"variant": a.variant, "trainable_params": sum(q.numel() for q in params),
            "loss_fn": loss_fn, "weighting": weighting, "max_anchors": kwargs["max_anchors"],
            "steps": plan["num_steps"],
            "ours_trainable_params": plan["drafter"]["trainable_params"]}
    print(json.dumps(info), flush=True)
    (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    shards = Shards(plan["capture"])
    with open(out / "train_log.tsv", "w") as log:  # a rerun trains from step 0 again
        t0 = time.time()
        for step, entry in enumerate(plan["steps"]):
            batch = pack([shards.sample(*r) for r in entry["rows"]])
            for g in opt.param_groups:  # the lr of this step in our schedule
                g["lr"] = entry["lr"]
            _, loss, metrics = model(**batch, **kwargs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan["gradient_clip_val"])
            opt.step()
            done = step + 1
            seconds = time.time() - t0
            log.write(f"{done}\t{float(loss.detach()):.5f}\t{entry['lr']:.3e}\t{seconds:.1f}\n")
            log.flush()
            if done % 10 == 0:
                print(f"step {done}/{plan['num_steps']} loss {float(loss.detach()):.4f} "
                      f"{(time.time() - t0) / done:.2f} s/step", flush=True)
            if done % a.save_every == 0 or done == plan["num_steps"]:
                save(model, out, done)


if __name__ == "__main__":
    main()
