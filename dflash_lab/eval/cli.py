"""dflash-eval: offline speculative evaluation of a DFlash drafter (conf/eval.yaml, docs/eval.md).

Thin entry point: config -> run info -> run_generate / run_features -> report files -> optional
wandb logging.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash_lab.eval.evaluate import MODES, run_features, run_generate
from dflash_lab.eval.report import write_report
from dflash_lab.paths import CONF_DIR
from dflash_lab.runinfo import write_run_info

log = logging.getLogger("dflash_lab.eval")
LOGGERS = ("none", "wandb")


def check_config(cfg: DictConfig) -> None:
    """Start-up validation of the choices that are not checked where they are used."""
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode!r}: use one of {list(MODES)}")
    if cfg.logger.name not in LOGGERS:
        raise ValueError(f"logger.name={cfg.logger.name!r}: use one of {list(LOGGERS)}")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        raise ValueError(f"num_prompts={cfg.num_prompts}: must be >= 1 (or null for all)")


def start_wandb(cfg: DictConfig):
    """A wandb run when ``logger.name=wandb`` (offline unless ``logger.mode=online``)."""
    if cfg.logger.name != "wandb":
        return None
    import wandb

    return wandb.init(project=cfg.logger.project, mode=cfg.logger.mode, name=cfg.logger.run_name,
                      dir=str(cfg.output_dir), job_type=f"eval-{cfg.mode}",
                      config=OmegaConf.to_container(cfg, resolve=True))


def log_to_wandb(run, report: dict[str, Any], out_dir: Path) -> None:
    """Scalar metrics under ``eval/``, the per-position curve and the plots."""
    import wandb

    scalars = {f"eval/{k}": v for k, v in report.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if report.get("lossless") is not None:
        scalars["eval/lossless"] = int(report["lossless"])
    for t, v in enumerate(report["per_position_acceptance"], start=1):
        if v is not None:
            scalars[f"eval/acc_pos{t}"] = v
    scalars.update({f"eval/{p.removesuffix('.png')}": wandb.Image(str(out_dir / p))
                    for p in report.get("plots", [])})
    run.log(scalars)
    run.finish()


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run one evaluation from a composed config; writes everything into ``cfg.output_dir``."""
    check_config(cfg)
    out_dir = Path(cfg.output_dir)
    write_run_info(out_dir, cfg, mode=cfg.mode)
    run = start_wandb(cfg)
    on_prompt = None
    if run is not None:
        def on_prompt(i, gen):
            lengths = gen.acceptance_lengths
            run.log({"eval/prompt_tau": sum(lengths) / max(len(lengths), 1), "prompt": i})
    report = (run_generate(cfg, on_prompt) if cfg.mode == "generate" else run_features(cfg))
    path = write_report(report, out_dir)
    log.info("tau_mean=%s speedup=%s lossless=%s -> %s", report.get("tau_mean"),
             report.get("speedup"), report.get("lossless"), path)
    if run is not None:
        log_to_wandb(run, report, out_dir)
    return report


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    evaluate(cfg)


def main() -> None:
    """Console entry point (``dflash-eval``)."""
    _hydra_main()


if __name__ == "__main__":
    main()
