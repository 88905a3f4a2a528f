"""Wire a composed training config into objects and run it (the body of ``dflash-train``), failing
fast: target, then the drafter for it, the data module (which validates captures against the
drafter) and the module, all before any long work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dflash_lab.data.shards import check_weights
from dflash_lab.entry import check_group_keys
from dflash_lab.export.api import ExportRefused, format_config, parse_engines, plan_export
from dflash_lab.export.checks import refusals
from dflash_lab.export.options import export_kwargs
from dflash_lab.export.outdir import check_output_dir
from dflash_lab.runinfo import latest_config, record_paths, write_run_info
from dflash_lab.terminal import progress_enabled
from dflash_lab.train.callbacks import ProgressLines, RecordTarget, RunEndCallback
from dflash_lab.train.checks import check_loss_data, check_train_config, data_class
from dflash_lab.train.draft_vocab import prepare_draft_vocab, write_record
from dflash_lab.train.resume import check_resume_config, resolve_ckpt_path
from dflash_lab.writer_lock import writer_lock

__all__ = ["build_components", "export_run", "resolve_ckpt_path", "train"]

log = logging.getLogger("dflash_lab.train")


def export_run(cfg: DictConfig, run_dir: Path) -> str:
    """Export the run's best checkpoint (logging it is ``WandbRun.on_run_end``'s work), replacing
    only an earlier export of this run (``owner``), never other files: train() checks
    ``export.out_dir`` the same way at start-up, so a bad one is refused before training."""
    from dflash_lab.export import export_drafter  # looked up per call (tests replace it)

    result = export_drafter(run_dir, cfg.export.out_dir, force=True, owner=run_dir,
                            **export_kwargs(export_section(cfg)))
    which = ("the best checkpoint" if (run_dir / "checkpoints" / "best.json").exists()
             else "the last checkpoint (no validation before the last step: no best one)")
    log.info("exported %s to %s", which, result.out_dir)
    return str(result.out_dir)


def build_components(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate target, drafter, data module, module, trainer (no training yet). Objects go in
    through partials: Hydra would turn the Target dataclass into a config node."""
    target = instantiate(cfg.target)
    drafter = instantiate(cfg.drafter, _partial_=True)(target=target)
    dc = drafter.config
    data_cls = data_class(cfg.data)
    if data_cls.runs_target and target.head_only:
        raise ValueError("target.head_only=true loads only the embedding, norm and LM head, but "
                         f"online data ({cfg.data._target_}) runs the whole target: use "
                         "data=offline (a capture) or target.head_only=false")
    data = instantiate(cfg.data, _partial_=True)(target=target, **data_cls.drafter_inputs(dc))
    data.prepare_data()
    data.setup("fit")  # reads and validates the data now, before any long work
    check_loss_data(cfg.module, data)
    pieces = target.pieces()
    record = prepare_draft_vocab(drafter, data.train_set, pieces.lm_head,
                                 str(cfg.module.get("label_source", "target_argmax")))
    if record is not None:
        log.info("draft vocabulary: %d of %d tokens (%s), covering %s of the training labels",
                 record["draft_vocab_size"], record["vocab_size"], record["counted"],
                 f"{record['coverage']:.1%}" if "coverage" in record else "n/a")
    module = instantiate(cfg.module, drafter=drafter, target_head=pieces,
                         feature_source=data.feature_source(),
                         target_distribution=data.target_distribution())
    logger = instantiate(cfg.logger) if cfg.logger.get("_target_") else False
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    callbacks.append(RecordTarget(target.identity()))
    if progress_enabled():  # under dflash-lab run: its live line
        callbacks.append(ProgressLines())
    trainer = instantiate(cfg.trainer, logger=logger, callbacks=callbacks)
    return {"target": target, "drafter": drafter, "data": data, "module": module,
            "trainer": trainer, "logger": logger, "draft_vocab": record}


def check_export_plan(cfg: DictConfig, drafter, target) -> None:
    """Refuse at start-up a run whose end-of-run export the engine rules would refuse (e.g. a
    Gemma 4 drafter for SGLang, which feeds that target's scaled embeddings): the rules and target
    class ``dflash-export`` applies, on the config.json of ``export.format`` (which refuses what
    that layout cannot carry: DFlash 2 as a Muse Glimmer assistant, Laguna features in ours)."""
    opts = export_kwargs(export_section(cfg))
    where = f"the drafter of this run (export.format={opts['format']})"
    raw = format_config(opts["format"], dataclasses.replace(drafter.config, _source=where),
                        opts["dtype"], None, vocab_known=True)
    _, findings = plan_export(
        drafter.config, parse_engines(opts["engine"]), sglang_version=opts["sglang_version"],
        sglang_backend=opts["sglang_backend"],
        target_architecture=target.identity().get("architecture"), raw=raw)
    if refusals(findings) and not opts["allow_lossy"]:
        raise ValueError(f"{ExportRefused(findings)}\nthe end-of-run export (export.engine="
                         f"{cfg.export.engine}) would be refused: set export.engine to the "
                         "engines that serve this drafter, or export.enabled=false")


def export_section(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.export`` as plain data (the keys of export/options.py)."""
    return OmegaConf.to_container(cfg.export, resolve=True)


def check_resume(cfg: DictConfig, out_dir: Path, ckpt: str | None) -> None:
    """A resume (``ckpt`` in this run directory) must match the run's latest recorded config
    (:func:`~dflash_lab.train.resume.check_resume_config`)."""
    recorded = latest_config(out_dir) if ckpt is not None else None
    if recorded is None:
        return
    current = OmegaConf.to_container(cfg, resolve=True)
    check_resume_config(recorded[1], current, str(recorded[0]),
                        allow=list(cfg.get("resume_allow_changes") or []),
                        force=bool(cfg.get("resume_force", False)))


def check_resume_target(cfg: DictConfig, out_dir: Path, ckpt: str | None, target) -> None:
    """A resume must load the checkpoint the run was trained with (weights fingerprint in the
    run's first run_info.json; runs from before fingerprints only warn)."""
    records = record_paths(out_dir) if ckpt is not None else []
    if not records or not records[0][1].is_file():
        return
    recorded = json.loads(records[0][1].read_text()).get("target") or {}
    allowed = "target.weights_fingerprint" in (cfg.get("resume_allow_changes") or [])
    check_weights(recorded, target.identity(), str(records[0][1]),
                  allow=allowed or bool(cfg.get("resume_force", False)),
                  override="resume_allow_changes=[target.weights_fingerprint]")


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train; returns {"val_tau_before", "val_tau_after", "best_checkpoint", "output_dir"}. All
    refusals come before the run record (config.yaml / run_info.json, or config.N.yaml on a
    resume), so a refused run leaves the directory as it was; a second ``dflash-train`` into it
    stops naming the first (:func:`writer_lock`, taken by global rank 0)."""
    check_group_keys(cfg)
    with writer_lock(cfg.paths.output_dir, what="paths.output_dir"):
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, Any]:
    L.seed_everything(cfg.seed, workers=True)
    out_dir = Path(cfg.paths.output_dir)
    if cfg.export.enabled:  # refuse an export.out_dir that the end-of-run export may not replace
        check_output_dir(cfg.export.out_dir, [out_dir], force=True, owner=out_dir,
                         name="export.out_dir")
    check_train_config(cfg)
    ckpt = resolve_ckpt_path(cfg.ckpt_path, out_dir)
    check_resume(cfg, out_dir, ckpt)
    parts = build_components(cfg)
    check_resume_target(cfg, out_dir, ckpt, parts["target"])
    if cfg.export.enabled:
        check_export_plan(cfg, parts["drafter"], parts["target"])
    write_run_info(out_dir, cfg, target=parts["target"].identity(), resumed_from=ckpt)
    write_record(out_dir, parts["draft_vocab"])
    trainer, module, data = parts["trainer"], parts["module"], parts["data"]
    if parts["logger"]:
        parts["logger"].log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    before = None
    start = "untrained" if cfg.drafter.get("init_from") is None else "warm-started"
    if cfg.validate_before_fit and ckpt is None:
        before = trainer.validate(module, datamodule=data, verbose=False)[0]["val/tau"]
        log.info("val/tau of the %s drafter: %.3f", start, before)
    if ckpt is not None:  # weights, optimizer and schedule come from our own checkpoint
        log.info("resuming from %s%s", ckpt, "" if start == "untrained" else
                 " (its weights replace drafter.init_from's)")
    # weights_only: a resumed checkpoint never runs pickled code, whatever
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says (our checkpoints hold tensors and plain data only).
    trainer.fit(module, datamodule=data, ckpt_path=ckpt, weights_only=True)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    after = trainer.validate(module, datamodule=data, ckpt_path=best or None, weights_only=True,
                             verbose=False)[0]["val/tau"]
    result = {"val_tau_before": before, "val_tau_after": after, "best_checkpoint": best,
              "output_dir": str(out_dir.absolute())}
    if cfg.export.enabled and trainer.is_global_zero:
        result["export_dir"] = export_run(cfg, out_dir)
    for callback in trainer.callbacks:  # e.g. WandbRun: the export as an artifact, then finish
        if isinstance(callback, RunEndCallback):
            callback.on_run_end(trainer, result)
    if trainer.is_global_zero:
        skipped = "n/a (resumed)" if ckpt is not None else "n/a (not measured)"
        before_txt = f"{before:.3f}" if before is not None else skipped
        tau = (f"{start} {before_txt} -> trained {after:.3f} (block size "
               f"{parts['drafter'].config.block_size})")
        print(summary(result, tau, next_commands(cfg, result)))
    return result


def summary(result: dict[str, Any], tau: str, commands: list[str]) -> str:
    """The block a run ends with (the last lines it prints): val tau before -> after, where the
    checkpoint, run directory and export are, and the commands to try next."""
    # none when no validation ran before the last step (trainer.max_steps below the first one)
    best = (result["best_checkpoint"]
            or "none (no validation before the last step; last.ckpt is used)")
    lines = ["", "== dflash-train summary", f"val tau: {tau}", f"best checkpoint: {best}",
             f"run directory: {result['output_dir']}"]
    if result.get("export_dir"):
        lines.append(f"export: {result['export_dir']}")
    return "\n".join(lines + [f"next: {c}" for c in commands])


def next_commands(cfg: DictConfig, result: dict[str, Any]) -> list[str]:
    """With an export: its speculative eval (the recipe's ``pipeline.eval`` settings, report in
    ``<run>/eval``); on the tiny target, then the ten-minute real-model recipe."""
    if not result.get("export_dir"):
        return []
    tiny = cfg.target.get("name_or_path") is None  # the built-in tiny target (target=tiny)
    target = (f"target=tiny target.path={cfg.target.path}" if tiny
              else f"target=hf target.name_or_path={cfg.target.name_or_path}")
    settings = " ".join(str(s) for s in cfg.pipeline.get("eval") or [])
    commands = [f"dflash-eval {target} drafter.path={result['export_dir']} {settings} "
                f"output_dir={Path(result['output_dir']) / 'eval'}".replace("  ", " ")]
    if tiny:
        commands.append("make prepare-smollm2 && dflash-lab run recipe=smollm2_10min  "
                        "(a real model, every stage, about ten minutes)")
    return commands
