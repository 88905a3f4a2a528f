"""NVIDIA ModelOpt's side of the quality comparison for LiLiCorr (issue 45,
``python -m scripts.compare_speculators variant=lilicorr|lilicorr_conv``), run from the
repository root with the ModelOpt venv's interpreter (``.venv-modelopt``, ``make
modelopt-venv``: ``nvidia-modelopt==0.48.0rc1``, the only release with LiLiCorr)::

    .venv-modelopt/bin/python -m benchmarks.modelopt_train --plan PLAN --target DIR --out DIR \\
        --save-every N --variant lilicorr --seed S

It must not import dflash_lab. It trains ModelOpt's own ``HFLiLiCorrModel`` on the batches of
``plan.json`` (``benchmarks/peer_quality.py plan``) and exports it with ModelOpt's own
``LiLiCorrExporter`` every ``--save-every`` steps (``OUT/step-N/``, read by our format registry).

What is theirs: the model as their recipe builds it (``modelopt_recipes/general/
speculative_decoding/<variant>.yaml``, read at run time through their ``load_recipe``; the target
loaded by their ``load_vlm_or_llm`` and converted by ``mtsp.convert(model, [("dflash", cfg)])``),
their seeding (``transformers.set_seed(--seed)`` before the conversion: their init; and the
recipe's ``training.seed`` set to ``--seed``, which HF ``Trainer`` reseeds the global generator
with when it is built: their anchor sampling, ``torch.rand``), their forward (anchor sampling, block
mask, the DFlash loss with their ``decay`` objective) and objective (their LiLiCorr weights
from the recipe: the DFlash CE + ``w_ce`` lattice CE + ``w_margin`` hinge + ``w_pen`` distractor
penalty), their optimizer and schedule as HF ``Trainer`` builds them from the recipe's
``training:`` section (``create_optimizer_and_scheduler``: AdamW at the recipe's lr and weight
decay with HF's betas and eps and its decay/no-decay groups, the recipe's ``lr_scheduler_type``
with ``warmup_ratio`` of the plan's steps) and HF's step (backward, clip at the recipe's
``max_grad_norm``, optimizer step, lr step, zero_grad).

Forced by the plan (``<variant>_not_default`` in run.json lists each one that differs from
their recipe, the comparison's seed too): the sequences per step (their
``per_device_train_batch_size``), the draft's layer count, block size, target layer
ids, mask id, the decay gamma (their ``dflash_loss_decay_factor``), the anchors per sequence
(their ``dflash_num_anchors`` is per row, and a row is one of our sequences), the lattice
fields (``lilicorr_*``; their recipe's are sized for Qwen3-8B) and the conv's, and the draft's
attention and MLP shape (the target's, as our drafter; their recipe's are Qwen3-8B's). A plan
field their config cannot express is a ValueError naming it (:func:`dflash_fields`).

CPU overrides (their recipe asks for a GPU): ``training.use_cpu=true``, ``training.tf32=false``
and ``training.bf16=false`` (float32, as our side; with float32 parameters their
``dflash_fp32_master_weights`` changes nothing: there is no lower-precision copy to keep).

Data: their OFFLINE mode (``data.offline_data_path`` set, so the recipe resolves
``dflash_offline``; the target is loaded without its decoder layers): per step the plan's
samples, each one row padded to a multiple of the block size (their forward's requirement)
with ``attention_mask`` and ``loss_mask`` 0 on the padding, and ``base_model_outputs``
``aux_hidden_states`` = our ``hidden`` (the tap layers' outputs concatenated; their
``hidden_states[lid + 1]`` is the same layer as our id ``lid``) and ``base_model_hidden_states``
= our ``target_last_hidden`` (final-normed, so ``base_hidden_prenorm`` false: their
``from_offline_dict`` applies their LM head to it for the penalty's target logits). Both sides
see the same target states. Before any step, argmax(their LM head(``target_last_hidden``)) must
match the stored ``target_argmax`` on the first batch's loss positions (the check and threshold
of benchmarks/speculators_train.py: another target's head, or pre-norm states, fail it).

Saves (:func:`export_step`): their exporter's ``config.json`` and ``model.safetensors``, with the
edits run.json lists under ``export_edits``: the head's two ``nn.Sequential`` indices renamed
to the engines' module names (vLLM's and SGLang's ``LiLiCorrHead``: ``feature_norm``,
``feature_mlp.up_proj/down_proj``, ``mlp.up_proj/down_proj``), ``dflash_config``'s
``lilicorr_enabled`` (true, the engines' default) and ``projector_type`` (read by no LiLiCorr
loader) dropped because our reader refuses keys it does not implement, and
``num_target_layers`` set to the target's (their offline model holds 0 layers).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.speculators_train import (
    Shards,
    _plan_drafter,
    argmax_agreement,
    bridge_args,
    capture_distribution,
    check_agreement,
    save,
    write_json,
)

#: --variant -> their recipe (modelopt_recipes/general/speculative_decoding/), our plan variant
RECIPES = {"lilicorr": ("general/speculative_decoding/lilicorr", "lilicorr"),
           "lilicorr_conv": ("general/speculative_decoding/lilicorr_conv", "lilicorr")}
#: the lattice fields: the same names in our plan and in their dflash_architecture_config
LATTICE = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
           "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
           "lilicorr_vector_eps", "lilicorr_logit_scale")
CONV = ("conv_kernel_size", "conv_group_size")
#: the draft's attention and MLP shape: the target's (our drafter is shaped like it)
SHAPE = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
#: their recipe asks for a GPU (bf16, tf32); float32 on CPU as our side
CPU_OVERRIDES = {"training.use_cpu": True, "training.tf32": False, "training.bf16": False}
#: their training-module names -> the engines' (vLLM's and SGLang's LiLiCorrHead)
ENGINE_NAMES = ((".feature_mlp.0.", ".feature_norm."), (".feature_mlp.1.", ".feature_mlp.up_proj."),
                (".feature_mlp.3.", ".feature_mlp.down_proj."), (".mlp.0.", ".mlp.up_proj."),
                (".mlp.2.", ".mlp.down_proj."))
#: dflash_config keys of their export that our reader does not implement (module docstring)
DROPPED_KEYS = ("lilicorr_enabled", "projector_type")


def target_shape(target: str | Path) -> dict:
    """The target's ``config.json`` fields of :data:`SHAPE` (``head_dim`` derived when absent)
    and ``num_hidden_layers``."""
    c = json.loads((Path(target) / "config.json").read_text())
    c = c.get("text_config", c)
    out = {k: c[k] for k in SHAPE if k in c}
    out.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return {**out, "num_hidden_layers": c["num_hidden_layers"]}


def dflash_fields(plan: dict, variant: str, shape: dict) -> dict:
    """``{dotted recipe key: value}`` the plan forces on their recipe (module docstring);
    ValueError naming the plan field their config cannot express."""
    d = _plan_drafter(plan, RECIPES[variant][1], "LiLiCorr")
    ids, layers = list(d["target_layer_ids"]), int(d["num_hidden_layers"])
    if len(ids) != layers:
        raise ValueError(
            f"the plan's drafter has target_layer_ids={ids} ({len(ids)} taps) and "
            f"num_hidden_layers={layers}: ModelOpt's DFlash config takes one target layer per "
            "draft layer (HFDFlashModel.modify refuses any other count); write the plan with "
            f"{layers} taps (python -m scripts.compare_speculators taps=[...] with {layers} ids) "
            f"or drafter.num_hidden_layers={len(ids)}")
    conv = {k: d.get(k) for k in CONV}
    if (variant == "lilicorr_conv") != (conv["conv_kernel_size"] is not None):
        key = "conv_kernel_size"
        raise ValueError(f"--variant {variant} but the plan's drafter has {key}="
                         f"{conv[key]}: their {variant} recipe "
                         f"{'builds' if variant == 'lilicorr_conv' else 'has no'} conv; write "
                         f"the plan with drafter={variant}")
    if d.get("sample_from_anchor"):
        raise ValueError("the plan's drafter has sample_from_anchor=True: ModelOpt's DFlash "
                         "block has the anchor in slot 0 (position k predicts anchor + k); "
                         "write the plan with drafter.sample_from_anchor=false")
    arch = {**{k: d[k] for k in LATTICE}, **{k: v for k, v in conv.items() if v is not None},
            **{k: shape[k] for k in SHAPE}, "num_hidden_layers": layers,
            "target_layer_ids": ids}
    return {"dflash.dflash_block_size": int(d["block_size"]),
            "dflash.dflash_num_anchors": int(plan["num_anchors_per_sequence"]),
            "dflash.dflash_mask_token_id": int(d["mask_token_id"]),
            "dflash.dflash_loss_decay_factor": float(plan["gamma"]),
            **{f"dflash.dflash_architecture_config.{k}": v for k, v in arch.items()}}


def dotlist(fields: dict) -> list[str]:
    """``key=value`` overrides for their ``load_recipe`` (JSON values parse as YAML)."""
    return [f"{k}={json.dumps(v)}" for k, v in fields.items()]


def lookup(recipe, key: str):
    """The value at a dotted recipe key (None when absent)."""
    node = recipe.model_dump()
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def their_recipe(variant: str, fields: dict | None = None, offline: str | None = None):
    """Their recipe for ``variant`` with the plan's ``fields``, the CPU overrides and
    ``data.offline_data_path`` (their offline mode) when given."""
    from modelopt.recipe.loader import load_recipe

    extra = {**CPU_OVERRIDES, **({"data.offline_data_path": offline} if offline else {}),
             **(fields or {})}
    return load_recipe(RECIPES[variant][0], overrides=dotlist(extra))


def build_model(target: str, recipe, seed: int):
    """Their LiLiCorr model on ``target``: loaded for offline training (no decoder layers),
    ``set_seed(seed)``, converted with the recipe's dflash section; float32, training mode."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers import set_seed

    model = load_vlm_or_llm(target, use_offline_training=True, dtype=torch.float32,
                            device_map="cpu")
    set_seed(seed)
    mtsp.convert(model, [("dflash", recipe.dflash.model_dump())])
    model.train()
    return model


def build_optimizer(model, recipe, num_steps: int, scratch: str):
    """(optimizer, scheduler, record) as HF ``Trainer`` builds them from the recipe's
    ``training:`` section (its HF fields: the keys ModelOpt's own schema does not define) over
    ``num_steps`` steps; ``scratch``: the Trainer's output_dir (it writes nothing there)."""
    from transformers import Trainer, TrainingArguments

    training = recipe.training.model_dump()
    own = set(type(recipe.training).model_fields)
    hf = {k: v for k, v in training.items() if k not in own and v is not None}
    if "warmup_ratio" in hf:  # transformers 5 spells a ratio as a float warmup_steps in [0, 1)
        hf["warmup_steps"] = float(hf.pop("warmup_ratio"))
    hf.update(output_dir=scratch, max_steps=num_steps, report_to="none")
    args = TrainingArguments(**hf)
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=num_steps)
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    return opt, sched, {
        "optimizer": type(opt).__name__, "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
        "warmup_steps_arg": hf.get("warmup_steps"),
        "warmup_steps": args.get_warmup_steps(num_steps),
        "total_steps": num_steps, "max_grad_norm": args.max_grad_norm,
        "optim": getattr(args.optim, "value", args.optim)}


def pad_batch(samples: list[dict[str, torch.Tensor]], block_size: int) -> dict:
    """Their offline forward's kwargs for the plan's samples: one row each, padded to L (the
    longest, rounded up to a multiple of ``block_size``). ``input_ids``, ``attention_mask``,
    ``loss_mask`` [B, L]; ``base_model_outputs``: ``aux_hidden_states`` [B, L, taps*H] and
    ``base_model_hidden_states`` [B, L, H] float32 (zeros on the padding)."""
    longest = max(len(s["input_ids"]) for s in samples)
    length = -(-longest // block_size) * block_size

    def row(t: torch.Tensor, dtype) -> torch.Tensor:
        pad = torch.zeros((length - len(t), *t.shape[1:]), dtype=dtype)
        return torch.cat([t.to(dtype), pad])

    stack = {k: torch.stack([row(s[k], dt) for s in samples]) for k, dt in (
        ("input_ids", torch.long), ("loss_mask", torch.float32), ("hidden", torch.float32),
        ("target_last_hidden", torch.float32))}
    mask = torch.stack([row(torch.ones(len(s["input_ids"])), torch.float32) for s in samples])
    return {"input_ids": stack["input_ids"], "attention_mask": mask,
            "loss_mask": stack["loss_mask"],
            "base_model_outputs": {"aux_hidden_states": stack["hidden"],
                                   "base_model_hidden_states": stack["target_last_hidden"],
                                   "base_hidden_prenorm": False}}


def export_step(model, num_target_layers: int):
    """A writer for :func:`benchmarks.speculators_train.save`: their exporter into the directory,
    then the edits of the module docstring (:func:`engine_layout`)."""

    def write(path: str) -> None:
        model.get_exporter().export(path, dtype=torch.float32)
        engine_layout(Path(path), num_target_layers)

    return write


def engine_layout(path: Path, num_target_layers: int) -> None:
    """Their export at ``path`` rewritten in place: tensor names of :data:`ENGINE_NAMES`,
    :data:`DROPPED_KEYS` dropped from ``dflash_config``, ``num_target_layers`` set."""
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    state = load_file(str(weights))
    renamed = {}
    for name, t in state.items():
        if name.startswith("lilicorr."):
            for old, new in ENGINE_NAMES:
                name = name.replace(old, new)
        renamed[name] = t
    save_file(renamed, str(weights))
    cfg = json.loads((path / "config.json").read_text())
    for key in DROPPED_KEYS:
        cfg["dflash_config"].pop(key, None)
    cfg["num_target_layers"] = num_target_layers
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def run_record(variant: str, recipe, fields: dict, defaults, model, opt_info: dict,
               plan: dict, seed: int) -> dict:
    """run.json: their recipe's values, what the plan forced where it differs from them, the
    CPU overrides, the optimizer record, the export edits."""
    params = [q for q in model.parameters() if q.requires_grad]
    keys = ("dflash_lilicorr_w_ce", "dflash_lilicorr_w_margin", "dflash_lilicorr_w_pen",
            "dflash_lilicorr_w_cal", "dflash_lilicorr_margin", "dflash_loss_objective",
            "dflash_self_logit_distillation", "dflash_fp32_master_weights")
    return {"variant": variant, "recipe": RECIPES[variant][0], "seed": seed,
            "steps": plan["num_steps"], "trainable_params": sum(q.numel() for q in params),
            "ours_trainable_params": plan["drafter"]["trainable_params"],
            "objective": {k: lookup(recipe, f"dflash.{k}") for k in keys},
            "offline": bool(recipe.dflash.dflash_offline), "optimizer": opt_info,
            f"{variant}_defaults": {k: lookup(defaults, k) for k in fields},
            f"{variant}_not_default": {k: v for k, v in fields.items()
                                       if lookup(defaults, k) != v},
            "cpu_overrides": CPU_OVERRIDES,
            "export_edits": {"renamed": dict(ENGINE_NAMES), "dropped": list(DROPPED_KEYS),
                             "num_target_layers": "the target's"}}


def main(argv: list[str] | None = None) -> None:
    a = bridge_args(__doc__, list(RECIPES), argv)
    plan = json.loads(Path(a.plan).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = target_shape(a.target)
    fields = {**dflash_fields(plan, a.variant, shape), "training.seed": a.seed,
              "training.per_device_train_batch_size": int(plan["batch_size"])}
    if not capture_distribution(plan["capture"])["last_hidden"]:
        raise ValueError(f"{plan['capture']} holds no target_last_hidden: their LiLiCorr "
                         "penalty (w_pen) reads the target's logits; recapture with "
                         "capture.distribution=[last_hidden] (compare_speculators "
                         "distribution=last_hidden)")
    recipe = their_recipe(a.variant, fields, offline=plan["capture"])
    model = build_model(a.target, recipe, a.seed)
    with tempfile.TemporaryDirectory() as scratch:
        opt, sched, opt_info = build_optimizer(model, recipe, plan["num_steps"], scratch)
    info = run_record(a.variant, recipe, fields, their_recipe(a.variant), model, opt_info,
                      plan, a.seed)
    shards = Shards(plan["capture"], ("input_ids", "loss_mask", "hidden", "target_last_hidden",
                                      "target_argmax"))
    # before any step: their LM head on the stored states must give the stored argmax
    first = [shards.sample(*r) for r in plan["steps"][0]["rows"]]
    cat = {k: torch.cat([s[k] for s in first]) for k in first[0]}
    info["argmax_agreement"] = argmax_agreement(model._base_model_lm_head,
                                                cat["target_last_hidden"],
                                                cat["target_argmax"], cat["loss_mask"])
    check_agreement(info["argmax_agreement"], plan["capture"], a.target)
    print(json.dumps(info), flush=True)
    write_json(out / "run.json", info)
    block, clip = fields["dflash.dflash_block_size"], opt_info["max_grad_norm"]
    params = [q for q in model.parameters() if q.requires_grad]
    write = export_step(model, shape["num_hidden_layers"])
    with open(out / "train_log.tsv", "w") as log:  # a rerun trains from step 0 again
        t0 = time.time()
        for step, entry in enumerate(plan["steps"]):
            batch = pad_batch([shards.sample(*r) for r in entry["rows"]], block)
            lr = opt.param_groups[0]["lr"]
            found = model(**batch)
            loss = found.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            done = step + 1
            log.write(f"{done}\t{float(loss.detach()):.5f}\t{lr:.3e}\t{time.time() - t0:.1f}\n")
            log.flush()
            if done % 10 == 0:
                terms = found.get("lilicorr_metrics") or {}
                print(f"step {done}/{plan['num_steps']} loss {float(loss.detach()):.4f} "
                      f"(dflash {terms.get('origin_loss', float('nan')):.4f}, lattice "
                      f"{terms.get('lilicorr_loss', float('nan')):.4f}) "
                      f"{(time.time() - t0) / done:.2f} s/step", flush=True)
            if done % a.save_every == 0 or done == plan["num_steps"]:
                save(model, out, done, write)


if __name__ == "__main__":
    main()
