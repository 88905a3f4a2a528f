"""dflash-eval: offline speculative evaluation of a DFlash drafter (conf/eval.yaml, docs/eval.md).
Thin entry point: config (groups target and logger, as dflash-train) -> run info ->
run_generate / run_features -> report files -> the logger (none | csv | wandb).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash_lab.entry import check_group_keys, check_renamed_keys, make_logger
from dflash_lab.errors import user_errors
from dflash_lab.eval.evaluate import MODES, run_features, run_generate
from dflash_lab.eval.loading import resolve_eval_target
from dflash_lab.eval.report import write_report
from dflash_lab.eval.server_eval import run_server
from dflash_lab.eval.suite import DATA_GROUP
from dflash_lab.paths import CONF_DIR
from dflash_lab.runinfo import write_run_info
from dflash_lab.serving.engine import BACKENDS
from dflash_lab.train.callbacks import WandbRun, log_final
from dflash_lab.writer_lock import writer_lock

log = logging.getLogger("dflash_lab.eval")
#: The command line as the user typed it (set by main; report.md shows it).
COMMAND: str | None = None
#: The eval's former hand-read keys (a ``logger.*`` key without a ``logger=`` choice) -> now.
_OLD_LOGGER_KEYS = {"logger.name": "logger=wandb|csv|none", "logger.mode": "logger=wandb "
                    "(offline) or logger=wandb logger.offline=false (online)",
                    "logger.run_name": "logger=wandb logger.name=NAME"}


def check_old_spellings(overrides: list[str]) -> None:
    """One-line ValueError for the command-line keys of the former eval config, with the new
    spelling (run before Hydra, whose own message would not name it)."""
    given = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o
                 and not o.startswith("-"))
    if "target.path" in given and given.get("target") != "tiny":
        value = given["target.path"]
        new = "target=tiny" if value == "tiny" else f"target=hf target.name_or_path={value}"
        raise ValueError(f"target.path={value} is the old dflash-eval spelling: use {new}")
    if "logger" not in given:
        for key, new in _OLD_LOGGER_KEYS.items():
            if key in given:
                raise ValueError(f"{key}={given[key]} is the old dflash-eval spelling: use {new}")


def data_group_overrides(argv: list[str]) -> list[str]:
    """``data=NAME`` (a dataset option of conf/eval_data/) as Hydra spells a group placed at
    ``data``: ``eval_data@data=NAME``; every other argument unchanged."""
    return [f"{DATA_GROUP}@data={a.split('=', 1)[1]}" if a.startswith("data=") else a
            for a in argv]


def check_config(cfg: DictConfig) -> None:
    """Start-up validation of the choices that are not checked where they are used."""
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode!r}: use one of {list(MODES)}")
    if cfg.get("backend", "local") not in BACKENDS:
        raise ValueError(f"backend={cfg.backend!r}: use one of {list(BACKENDS)}")
    if cfg.get("backend") == "server" and cfg.mode != "generate":
        raise ValueError(f"backend=server measures generation in the engine; mode={cfg.mode} "
                         "runs here only: use mode=generate or backend=local")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        raise ValueError(f"num_prompts={cfg.num_prompts}: must be >= 1 (or null for all)")


def log_report(logger, cfg: DictConfig, report: dict[str, Any], out_dir: Path) -> None:
    """Scalars under ``eval/``, the curve ``eval/acc_posT`` and (wandb:
    :class:`~dflash_lab.train.callbacks.WandbRun`) the plots and suite table; then closes it."""
    metrics = {f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))}
    metrics |= {f"eval/acc_pos{t}": v
                for t, v in enumerate(report["per_position_acceptance"], start=1) if v is not None}
    datasets = report.get("datasets") or {}
    if len(datasets) > 1:  # a suite: each dataset's row under eval/<dataset>/, and the table
        for name, row in datasets.items():
            metrics.update({f"eval/{name}/{k}": v for k, v in row.items()
                            if isinstance(v, (int, float))})
        columns = ["dataset", *(k for k, v in next(iter(datasets.values())).items()
                                if not isinstance(v, list))]
        WandbRun.log_table(logger, key="eval/datasets", columns=columns,
                           data=[[n, *(row[c] for c in columns[1:])]
                                 for n, row in datasets.items()])
    WandbRun.log_images(logger, {f"eval/{Path(plot).stem}": str(out_dir / plot)
                                 for plot in report.get("plots", [])})
    log_final(logger, cfg, metrics)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """One evaluation of a composed config into ``cfg.output_dir`` (one at a time: writer_lock)."""
    check_group_keys(cfg)
    with writer_lock(cfg.output_dir, what="output_dir"):
        check_config(cfg)
        resolve_eval_target(cfg)
        logger = make_logger(cfg.logger)
        out_dir = Path(cfg.output_dir)
        on_prompt = None
        if logger is not None:
            def on_prompt(i, gen):
                lengths = gen.acceptance_lengths
                logger.log_metrics({"eval/prompt_tau": sum(lengths) / max(len(lengths), 1)}, step=i)
        if cfg.get("backend") == "server":
            def on_response(i, response):
                if logger is not None and response.tau is not None:
                    logger.log_metrics({"eval/prompt_tau": response.tau}, step=i)
            report = run_server(cfg, on_response)
        else:
            report = run_generate(cfg, on_prompt) if cfg.mode == "generate" else run_features(cfg)
        report["command"] = COMMAND or shlex.join(sys.argv)
        # the record with the report: an eval refused at start-up (a bad prompt file, a missing
        # target) leaves no files behind
        write_run_info(out_dir, cfg, mode=cfg.mode)
        path = write_report(report, out_dir)
        log.info("tau_mean=%s speedup=%s lossless=%s -> %s", report.get("tau_mean"),
                 report.get("speedup"), report.get("lossless"), path)
        if logger is not None:
            log_report(logger, cfg, report, out_dir)
        return report


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        evaluate(cfg)


def main() -> None:
    """Console entry point (``dflash-eval``) without a recipe (with one: dflash_lab.commands)."""
    global COMMAND
    with user_errors():
        check_old_spellings(sys.argv[1:])
        check_renamed_keys(sys.argv[1:])
    COMMAND = shlex.join(["dflash-eval", *sys.argv[1:]])
    sys.argv[1:] = data_group_overrides(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
