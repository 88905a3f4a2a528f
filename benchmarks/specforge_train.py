"""SpecForge's side of the quality comparison for Domino (issue 45,
``python -m scripts.compare_speculators variant=domino``), run from the repository root with the
SpecForge venv's interpreter (``.venv-specforge``, ``make specforge-venv``: ``specforge==0.2.0``
installed --no-deps, no sglang)::

    .venv-specforge/bin/python -m benchmarks.specforge_train --plan PLAN --target DIR --out DIR \\
        --save-every N --variant domino --seed S

It must not import dflash_lab. It trains SpecForge's own Domino (``DominoDraftModel`` inside
their ``OnlineDominoModel``) on the batches of ``plan.json`` (``benchmarks/peer_quality.py
plan``) and saves the draft with their ``save_pretrained`` every ``--save-every`` steps
(``OUT/step-N/``, read by our format registry as a Domino drafter).

What is theirs: the draft model (``AutoDraftModel.from_config`` on a Qwen3 draft config shaped
like the target's layers, as their Domino example configs are: Domino has no generated config,
its ``--draft-model-config`` is a Qwen3 JSON plus ``block_size``, ``num_target_layers`` and
``dflash_config``), the frozen target embedding and LM head their ``TargetEmbeddingsAndHead``
loads, their seeding (``accelerate.utils.set_seed(--seed)`` before the draft is built, as their
``specforge train`` CLI does; it drives their init and their anchor sampling, ``torch.rand`` on
the global generator), their forward (``OnlineDominoModel``: anchors over the supervised
positions of every row, their block mask, shift_label false: slot k predicts anchor + k, their
GRU correction on the teacher-forced tokens) and objective ((1 - lambda) CE(final) + lambda
CE(base), both weighted by exp(-(k - 1) / gamma) and divided by the weight sum; their labels are
the data tokens, ``input_ids`` at anchor + k, where our CE arm's are the stored target argmax),
lambda from their ``DominoTrainStrategy`` (``linear_lambda_base``: lambda_base_start 1 to 0 over
lambda_base_decay_ratio of the steps, at their controller's ``StepContext(global_step,
total_steps)``), and their optimizer: ``BF16Optimizer`` at their ``TrainingConfig`` defaults
(AdamW on fp32 master copies, lr 1e-4, weight decay 0, their global-norm clip at
max_grad_norm 0.5, their cosine schedule with warmup_ratio 0.015 of the plan's steps), and
their step: ``TrainerCore.train_step`` (forward_loss, backward of loss / accumulation_steps 1
through their training backend, ``optimizer.step()``). run.json records every value.

Not theirs (said in run.json ``bypassed``): their ``Trainer`` loop around that step, the
backend's DDP/FSDP wrapper and their offline reader and sampler. Their sampler shuffles
``.ckpt`` files with its own seed; the plan's order must be fed exactly, so each step's samples
go through their offline normalizer (``normalize_offline_sample``) and their collator
(``build_collator``: rows zero-padded to the longest) into a ``TrainBatch`` for their
``TrainerCore``. Their backend holds the model unwrapped (``prepare_model(wrap=False)``): FSDP
refuses CPU, and the DDP of their CPU shim (``FSDP_SHARDING=NO_SHARD``, gloo) would hold one
replica on one process and leave the gradients as they are.

Forced by the plan (``domino_not_default`` in run.json lists each one that differs from their
defaults): the draft's layers, block size, target layer ids, mask id and Domino fields
(``emb_dim``, ``gru_hidden_dim``, ``pure_draft_prefix_len``, ``shift_label`` false) from our
conf/drafter/domino.yaml; ``training.num_anchors`` (theirs is per row, a row is one of our
sequences) = the plan's anchors per sequence; ``training.loss_decay_gamma`` = gamma;
``training.batch_size`` = the plan's sequences per step; ``training.total_steps`` = the plan's
steps; ``training.seed``. A plan field their config cannot express is a ValueError naming it
(:func:`draft_config_fields`).

CPU shim: ``training.attention_backend=sdpa`` (their default flex_attention needs a compiled
kernel) and ``model.torch_dtype=float32`` (their default bfloat16; float32 as our side: their
fp32 masters then hold the same numbers as the parameters).

Data: per step the plan's samples as their offline ``.ckpt`` features hold them: ``input_ids``
[S], ``loss_mask`` [S], ``hidden_states`` [1, S, taps*H] = our ``hidden`` (the tap layers'
outputs concatenated, float32).

Saves: their draft's ``save_pretrained`` (``config.json`` + ``model.safetensors``: their HF
export, ``specforge.export.to_hf``, is the same call), with the one edit run.json lists under
``export_edits``: ``architectures`` ``DominoDraftModel`` -> ``DFlashDraftModel`` (SGLang's
name: its loader reads ``dflash_config.projector_type`` and our reader follows it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.speculators_train import Shards, _plan_drafter, bridge_args, save, write_json

#: the Domino fields: the same names in our plan and in their dflash_config
DOMINO = ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label")
#: the target config fields their Qwen3 draft layers take (our drafter is shaped like the target)
SHAPE = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act",
         "rope_parameters")
#: CPU shim (module docstring): their defaults are flex_attention and bfloat16
CPU_SHIM = {"training.attention_backend": "sdpa", "model.torch_dtype": "float32"}
#: keys of their TrainingConfig whose defaults run.json records
TRAINING_KEYS = ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm",
                 "accumulation_steps", "num_anchors", "loss_decay_gamma",
                 "objective_chunk_blocks", "lambda_base_start", "lambda_base_decay_ratio",
                 "batch_size", "total_steps", "seed", "attention_backend", "fsdp_sharding")
#: their export's architecture -> SGLang's (module docstring, ``export_edits``)
ARCHITECTURES = {"DominoDraftModel": "DFlashDraftModel"}


def target_config(target: str | Path) -> dict:
    """The target's ``config.json`` (its ``text_config`` for a multimodal one), ``head_dim``
    derived when absent."""
    c = json.loads((Path(target) / "config.json").read_text())
    c = c.get("text_config", c)
    return {**c, "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]}


def draft_config_fields(plan: dict, target: dict) -> dict:
    """Their draft config (a Qwen3 config dict plus ``block_size``, ``num_target_layers`` and
    ``dflash_config``) for the plan's drafter on ``target`` (:func:`target_config`);
    ValueError naming the plan field their config cannot express."""
    d = _plan_drafter(plan, "domino", "Domino")
    if d.get("projector_type", "domino") != "domino":
        raise ValueError(f"the plan's drafter has projector_type={d['projector_type']!r}: "
                         "their DominoDraftModel requires 'domino'; write the plan with "
                         "drafter=domino")
    if d.get("sample_from_anchor"):
        raise ValueError("the plan's drafter has sample_from_anchor=True: their Domino block has "
                         "the anchor in slot 0 (slot k predicts anchor + k); write the plan "
                         "with drafter.sample_from_anchor=false")
    if d.get("draft_vocab_size") is not None:
        raise ValueError(f"the plan's drafter has draft_vocab_size={d['draft_vocab_size']}: "
                         "their embed_proj and LM head span the target's vocabulary; write the "
                         "plan with drafter.draft_vocab_size=null")
    for key in ("hidden_size", "vocab_size"):
        if key in d and d[key] != target[key]:
            raise ValueError(f"the plan's drafter has {key}={d[key]}, the target {target[key]}: "
                             "their draft layers are the target's shape; pass the capture's "
                             "own --target")
    if not isinstance(d["block_size"], int) or d["block_size"] < 2:
        raise ValueError(f"the plan's drafter has block_size={d['block_size']}: their "
                         "DFlash-family config needs an integer block_size >= 2")
    layers = int(d["num_hidden_layers"])
    shape = {k: target[k] for k in SHAPE if target.get(k) is not None}
    return {**shape, "architectures": ["DominoDraftModel"], "model_type": "qwen3",
            "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers,
            "sliding_window": None, "use_sliding_window": False, "attention_bias": False,
            "tie_word_embeddings": False, "block_size": int(d["block_size"]),
            "num_target_layers": int(target["num_hidden_layers"]),
            "dflash_config": {"projector_type": "domino",
                              "target_layer_ids": [int(i) for i in d["target_layer_ids"]],
                              "mask_token_id": int(d["mask_token_id"]),
                              **{k: d[k] for k in DOMINO}}}


def training_fields(plan: dict, seed: int) -> dict:
    """``{dotted config key: value}`` the plan forces on their TrainingConfig, and the shim."""
    return {"training.num_anchors": int(plan["num_anchors_per_sequence"]),
            "training.loss_decay_gamma": float(plan["gamma"]),
            "training.batch_size": int(plan["batch_size"]),
            "training.total_steps": int(plan["num_steps"]), "training.seed": seed, **CPU_SHIM}


def their_defaults() -> dict:
    """Their ``TrainingConfig()`` and ``ModelConfig`` defaults (read at run time) under the
    keys of :data:`TRAINING_KEYS` and ``model.torch_dtype``."""
    from specforge.config.schema import ModelConfig, TrainingConfig

    t = TrainingConfig()
    return {**{f"training.{k}": getattr(t, k) for k in TRAINING_KEYS},
            "model.torch_dtype": ModelConfig.model_fields["torch_dtype"].default}


def build_model(target: str, draft: dict, config: dict):
    """Their ``OnlineDominoModel`` over their draft (``AutoDraftModel.from_config`` of
    ``draft``, float32) with the target's frozen embedding and LM head, as their
    ``build_domino_model`` builds it from ``config`` (:func:`training_fields` over
    :func:`their_defaults`)."""
    from specforge.algorithms.common.dflash_family_model import OnlineDominoModel
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from transformers import Qwen3Config

    dtype = getattr(torch, config["model.torch_dtype"])
    cfg = Qwen3Config(**{k: v for k, v in draft.items() if k != "model_type"})
    cfg._attn_implementation = config["training.attention_backend"]
    model = AutoDraftModel.from_config(cfg, torch_dtype=dtype).to(dtype=dtype)
    model.mask_token_id = draft["dflash_config"]["mask_token_id"]
    parts = TargetEmbeddingsAndHead.from_pretrained(target, device="cpu", dtype=dtype)
    return OnlineDominoModel(
        draft_model=model, target_lm_head=parts.lm_head, target_embed_tokens=parts.embed_tokens,
        mask_token_id=model.mask_token_id, block_size=int(model.block_size),
        attention_backend=config["training.attention_backend"],
        num_anchors=config["training.num_anchors"],
        loss_decay_gamma=config["training.loss_decay_gamma"],
        objective_chunk_blocks=config["training.objective_chunk_blocks"],
        shift_label=bool(model.shift_label)).to(dtype=dtype)


def build_step(model, config: dict):
    """(their ``TrainerCore``, their BF16Optimizer, record) at ``config``'s values: their
    DominoTrainStrategy over ``model`` and their training backend holding it unwrapped
    (``prepare_model(wrap=False)``: one CPU process, no DDP/FSDP wrapper, no collective)."""
    from specforge.optimizer import BF16Optimizer
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import DominoTrainStrategy

    strategy = DominoTrainStrategy(model, lambda_start=config["training.lambda_base_start"],
                                   decay_ratio=config["training.lambda_base_decay_ratio"])
    opt = BF16Optimizer(model, lr=config["training.learning_rate"],
                        max_grad_norm=config["training.max_grad_norm"],
                        total_steps=config["training.total_steps"],
                        warmup_ratio=config["training.warmup_ratio"],
                        lr_scheduler=config["training.lr_scheduler"])
    backend = FSDPTrainingBackend(ParallelConfig(
        sharding_strategy="NO_SHARD", param_dtype=getattr(torch, config["model.torch_dtype"])))
    backend.prepare_model(model, wrap=False)
    backend.set_optimizer(opt)
    core = TrainerCore(strategy, backend,
                       accumulation_steps=config["training.accumulation_steps"])
    group = opt.optimizer.param_groups[0]
    return core, opt, {
        "optimizer": f"BF16Optimizer({type(opt.optimizer).__name__})",
        "lr": config["training.learning_rate"], "lr_first_step": group["lr"],
        "betas": list(group["betas"]), "eps": group["eps"],
        "weight_decay": group["weight_decay"], "lr_scheduler": opt.lr_scheduler_type,
        "warmup_steps": int(config["training.warmup_ratio"] * config["training.total_steps"]),
        "total_steps": config["training.total_steps"], "max_grad_norm": opt.max_grad_norm,
        "lambda_base_start": strategy.lambda_start, "decay_ratio": strategy.decay_ratio}


def their_batch(samples: list[dict[str, torch.Tensor]], step: int):
    """The plan's samples of one step as their collated ``TrainBatch``: each through their
    offline normalizer (``input_ids`` [S], ``loss_mask`` [S], ``hidden_states`` [1, S,
    taps*H] float32, no truncation), then their collator: [B, L] and [B, L, taps*H]."""
    from specforge.algorithms.common.dflash_family_data import (
        build_collator,
        normalize_offline_sample,
    )
    from specforge.runtime.contracts import TrainBatch

    rows = [normalize_offline_sample(
        {"input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"].long(),
         "hidden_states": s["hidden"].float()[None]}, len(s["input_ids"])) for s in samples]
    return TrainBatch(sample_ids=[f"{step}-{i}" for i in range(len(rows))], strategy="domino",
                      tensors=build_collator()(rows))


def save_draft(model):
    """A writer for :func:`benchmarks.speculators_train.save`: their ``save_pretrained`` of
    the draft, then the ``architectures`` edit of :data:`ARCHITECTURES`."""

    def write(path: str) -> None:
        model.draft_model.save_pretrained(path, safe_serialization=True)
        file = Path(path) / "config.json"
        cfg = json.loads(file.read_text())
        cfg["architectures"] = [ARCHITECTURES.get(a, a) for a in cfg.get("architectures", [])]
        file.write_text(json.dumps(cfg, indent=2) + "\n")

    return write


def run_record(plan: dict, draft: dict, fields: dict, defaults: dict, model, opt_info: dict,
               seed: int) -> dict:
    """run.json: their defaults, what the plan forced where it differs from them (the Domino
    prefix too: their dflash_config default 0), the shim, the optimizer, the bypassed parts."""
    params = [q for q in model.parameters() if q.requires_grad]
    dfc = draft["dflash_config"]
    return {"variant": "domino", "seed": seed, "steps": plan["num_steps"],
            "trainable_params": sum(q.numel() for q in params),
            "ours_trainable_params": plan["drafter"]["trainable_params"],
            "draft_config": draft, "optimizer": opt_info,
            "objective": "(1 - lambda) CE(final) + lambda CE(base), exp(-(k-1)/gamma) "
                         "weights, labels input_ids at anchor + k (the data tokens)",
            "domino_defaults": {**defaults, "dflash_config.pure_draft_prefix_len": 0,
                                "dflash_config.shift_label": False},
            "domino_not_default": {
                **{k: v for k, v in fields.items() if defaults.get(k) != v},
                **{f"dflash_config.{k}": dfc[k] for k, off in
                   (("pure_draft_prefix_len", 0), ("shift_label", False)) if dfc[k] != off}},
            "cpu_shim": CPU_SHIM,
            "bypassed": "their Trainer loop around TrainerCore.train_step, the backend's "
                        "DDP/FSDP wrapper (wrap=False), their offline reader and sampler: the "
                        "plan's samples go through their normalizer and collator in its order",
            "export_edits": {"architectures": ARCHITECTURES}}


def main(argv: list[str] | None = None) -> None:
    a = bridge_args(__doc__, ["domino"], argv)
    from accelerate.utils import set_seed

    plan = json.loads(Path(a.plan).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = draft_config_fields(plan, target_config(a.target))
    fields, defaults = training_fields(plan, a.seed), their_defaults()
    config = {**defaults, **fields}
    set_seed(a.seed)
    model = build_model(a.target, draft, config)
    model.train()
    core, opt, opt_info = build_step(model, config)
    info = run_record(plan, draft, fields, defaults, model, opt_info, a.seed)
    print(json.dumps(info), flush=True)
    write_json(out / "run.json", info)
    from specforge.training.strategies.base import StepContext

    shards = Shards(plan["capture"], ("input_ids", "loss_mask", "hidden"))
    write, total = save_draft(model), plan["num_steps"]
    with open(out / "train_log.tsv", "w") as log:  # a rerun trains from step 0 again
        t0 = time.time()
        for step, entry in enumerate(plan["steps"]):
            batch = their_batch([shards.sample(*r) for r in entry["rows"]], step)
            lr = opt.get_learning_rate()
            # their step: forward_loss, backward, their clip + AdamW + schedule, zero_grad
            found = core.train_step(batch, StepContext(global_step=step, total_steps=total))
            assert found.optimizer_stepped  # accumulation_steps 1: a boundary every step
            done = step + 1
            m = found.metrics
            log.write(f"{done}\t{found.loss:.5f}\t{lr:.3e}\t"
                      f"{time.time() - t0:.1f}\n")
            log.flush()
            if done % 10 == 0:
                print(f"step {done}/{total} loss {found.loss:.4f} (final "
                      f"{float(m['final_loss']):.4f}, base {float(m['base_loss']):.4f}, lambda "
                      f"{float(m['lambda_base']):.3f}) {(time.time() - t0) / done:.2f} s/step",
                      flush=True)
            if done % a.save_every == 0 or done == total:
                save(model, out, done, write)


if __name__ == "__main__":
    main()
