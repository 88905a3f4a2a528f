"""``dflash-lab run recipe=NAME``: a recipe's stages (capture, train, export, eval) in order, each
the existing command as a subprocess with its folder under one run root, so each finds the one
before it; a finished stage's ``<root>/stages/<stage>.json`` lets a rerun skip it while its
inputs and recorded outputs are unchanged (docs/pipeline.md).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash_lab.checksums import sha256_file, sha256_of
from dflash_lab.paths import CONF_DIR, atomic_write_text, remove_path
from dflash_lab.pipeline_args import (
    capture_layers,
    compose,
    export_options,
    hydra_value,
    is_offline,
    option_args,
    stage_config,
    target_args,
    target_location,
)
from dflash_lab.runinfo import git_sha
from dflash_lab.serving.launch import log_tail
from dflash_lab.terminal import PROGRESS_ENV, StageOutput, setup

STAGES = ("regenerate", "capture", "train", "export", "eval")
#: A further eval of the export, ``pipeline.evals.NAME`` of the recipe: stage ``eval_NAME``.
EVAL_PREFIX = "eval_"
#: The Python module each stage runs (``python -m MODULE ARGS``).
MODULES = {"regenerate": "dflash_lab.regenerate", "capture": "dflash_lab.capture",
           "train": "dflash_lab.train.cli", "export": "dflash_lab.export.cli",
           "eval": "dflash_lab.eval.cli"}
USAGE = ("usage: dflash-lab run recipe=NAME [stages=[regenerate,capture,train,export,eval,"
         "eval_NAME]] [force=[STAGE,...]] [root=DIR] [STAGE:OVERRIDE ...] [OVERRIDE ...]")


def is_stage_name(name: str) -> bool:
    """One of :data:`STAGES`, or ``eval_NAME`` (a recipe's further eval)."""
    return name in STAGES or (name.startswith(EVAL_PREFIX) and len(name) > len(EVAL_PREFIX))


def command_of(stage: Stage) -> list[str]:
    """``python -m MODULE ARGS`` (an ``eval_NAME`` stage runs the eval's module)."""
    module = MODULES["eval" if stage.name.startswith(EVAL_PREFIX) else stage.name]
    return [sys.executable, "-m", module, *stage.args]


@dataclass
class Request:
    """The parsed command line: ``stage_args[s]`` are the ``s:``-prefixed arguments."""

    recipe: str
    root: Path
    stages: list[str] | None = None
    force: list[str] = field(default_factory=list)
    stage_args: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


@dataclass
class Stage:
    """One stage as it will run: its command, the config it composes (hashed into ``inputs``),
    the paths that must exist after it, and the folder it owns."""

    name: str
    args: list[str]
    composed: Any
    outputs: list[Path]
    folder: Path


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]


def parse_args(argv: list[str]) -> Request:
    """``run recipe=X ...`` -> :class:`Request`; a bad stage name raises naming the choices."""
    if not argv or argv[0] != "run":
        raise ValueError(f"expected the subcommand `run`, got {argv[:1] or 'nothing'}\n{USAGE}")
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:]
             if a.split("=", 1)[0] in ("recipe", "root", "stages", "force") and "=" in a}
    if not given.get("recipe"):  # an unknown name: Hydra's error lists the recipes
        raise ValueError(f"give recipe=NAME (a file in {CONF_DIR / 'recipe'})\n{USAGE}")
    req = Request(given["recipe"], Path(given.get("root") or f"outputs/pipeline/{given['recipe']}"))
    req.stages = _names(given["stages"]) if "stages" in given else None
    req.force = _names(given.get("force", ""))
    for arg in argv[1:]:
        if arg.split("=", 1)[0] in given:
            continue
        if _is_routed(arg):
            stage, _, rest = arg.partition(":")
            req.stage_args[stage].append(rest)
        else:
            req.stage_args["train"].append(arg)
    for what, names in (("stages", req.stages or []), ("force", req.force)):
        _check_names(what, names)
    return req


def _check_names(what: str, names: list[str]) -> None:
    bad = [n for n in names if not is_stage_name(n)]
    if bad:
        raise ValueError(f"{what}={names}: unknown stage {bad[0]!r}; the stages are "
                         f"{list(STAGES)} and eval_NAME for each of the recipe's pipeline.evals")


def recipe_stages(req: Request, train_cfg: DictConfig) -> list[str]:
    """The stages the recipe runs (``pipeline.stages``, else all it can, regenerate only when
    listed), then one ``eval_NAME`` per ``pipeline.evals`` entry; checked."""
    offline = is_offline(train_cfg)
    listed = train_cfg.pipeline.get("stages")
    where = f"recipes/{req.recipe}.yaml pipeline.stages"
    evals = [EVAL_PREFIX + name for name in (train_cfg.pipeline.get("evals") or {})]
    if listed is None:
        return [s for s in STAGES if s != "regenerate" and (offline or s != "capture")] + evals
    _check_names(where, list(listed))
    for stage in ("capture", "regenerate"):
        if stage in listed and not offline:
            raise ValueError(f"{where} lists {stage}, but the recipe trains on online data (no "
                             "capture); remove it or use data=offline")
    if "regenerate" in listed and "capture" not in listed:
        raise ValueError(f"{where} lists regenerate without capture: the capture stage reads "
                         "the regenerated conversations")
    return [s for s in STAGES if s in listed] + [e for e in evals if e in listed]


def _at(root: Path, stage: str) -> str:
    """A stage's folder as a Hydra override value."""
    return hydra_value(str(root / stage))


def plan(req: Request) -> list[Stage]:
    """Every stage the recipe runs, with its arguments, composed config and outputs."""
    root = req.root
    train_args = [f"recipe={req.recipe}", *req.stage_args["train"]]
    first = compose("train", train_args)
    offline = is_offline(first)
    derived = [f"paths.output_dir={_at(root, 'train')}", "export.enabled=false"]
    derived += [f"data.path={_at(root, 'capture')}"] if offline else []
    train_args += derived
    cfg = compose("train", train_args)
    steps = OmegaConf.to_container(cfg.pipeline, resolve=True)
    from dflash_lab.data.regenerate_loop import MERGED_FILE
    from dflash_lab.export.weights import WEIGHTS_FILE

    targets = target_args(cfg)
    regenerate = targets + [f"regenerate.settings.out_dir={_at(root, 'regenerate')}",
                            *steps["regenerate"], *req.stage_args["regenerate"]]
    regenerated = (  # the capture reads the regenerated rows, all of them, in their order
        [f"data.path={_at(root, 'regenerate/' + MERGED_FILE)}", "data.limit=null",
         "data.shuffle_seed=null"] if "regenerate" in recipe_stages(req, cfg) else [])
    capture = targets + capture_layers(cfg) + [f"capture.out_dir={_at(root, 'capture')}",
                                                 *steps["capture"], *regenerated,
                                                 *req.stage_args["capture"]]
    export = [str(root / "train"), str(root / "export"), "--force",
              f"--target={target_location(cfg)}",
              *export_options(OmegaConf.to_container(cfg.export, resolve=True)),
              *option_args([*steps["export"], *req.stage_args["export"]])]

    def eval_stage(name: str, listed: list[str]) -> Stage:
        args = targets + [f"drafter.path={_at(root, 'export')}", f"output_dir={_at(root, name)}",
                          *listed, *req.stage_args[name]]
        return Stage(name, args, stage_config("eval", args), [root / name / "report.json"],
                     root / name)

    train_view = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items()
                  if k not in ("pipeline", "export", "hydra")}
    make = {
        "regenerate": lambda: Stage("regenerate", regenerate,
                                    stage_config("regenerate", regenerate),
                                    [root / "regenerate" / MERGED_FILE], root / "regenerate"),
        "capture": lambda: Stage("capture", capture, stage_config("capture", capture),
                                 [root / "capture" / "manifest.json"], root / "capture"),
        "train": lambda: Stage("train", train_args, train_view,
                               [root / "train" / "checkpoints" / "last.ckpt"], root / "train"),
        "export": lambda: Stage("export", export, export, [root / "export" / "config.json",
                                                           root / "export" / WEIGHTS_FILE],
                                root / "export"),
        "eval": lambda: eval_stage("eval", steps["eval"]),
    }
    evals = steps.get("evals") or {}
    # a further eval is the main eval's settings (the recipe's, then eval:KEY=VALUE), then its
    # own (e.g. another data.path), so a shrunk eval (eval:num_prompts=4) shrinks them all
    return [make[name]() if name in make
            else eval_stage(name, [*steps["eval"], *req.stage_args["eval"],
                                   *evals[name[len(EVAL_PREFIX):]]])
            for name in recipe_stages(req, cfg)]


# ----------------------------------------------------------------------------- records and runs

def record_path(root: Path, stage: str) -> Path:
    return root / "stages" / f"{stage}.json"


def inputs_of(stage: Stage, before: Stage | None, root: Path) -> dict[str, Any]:
    """What a stage's result depends on: its composed config and the record of the stage
    before it (rewritten whenever that one reruns, so a rerun upstream reruns this one)."""
    upstream = record_path(root, before.name) if before else None
    return {"config": sha256_of(stage.composed),
            "upstream": (sha256_of(upstream.read_text()) if upstream and upstream.is_file()
                         else None)}


#: :func:`stale`'s reason for a stage that never finished here (it runs without a word).
NO_RECORD = "no record"


def stale(stage: Stage, inputs: dict[str, Any], root: Path) -> str | None:
    """Why the stage must run (again), or None when it is done: no record, other inputs, or an
    output it recorded (or now writes) that is missing or no longer has its recorded sha256.
    A record from before the checksums (a list of outputs) is checked for presence only."""
    path = record_path(root, stage.name)
    if not path.is_file():
        return NO_RECORD
    record = json.loads(path.read_text())
    if record.get("inputs") != inputs:
        return "its inputs changed"
    recorded = record["outputs"]
    recorded = dict.fromkeys(recorded) if isinstance(recorded, list) else recorded
    for name in [*recorded, *(str(p) for p in stage.outputs if str(p) not in recorded)]:
        if not Path(name).is_file():
            return f"{name} is missing"
        want = recorded.get(name)
        if want is not None and sha256_file(Path(name)) != want:
            return f"{name} changed since {path} recorded it (sha256 differs)"
    return None


def write_record(stage: Stage, inputs: dict[str, Any], started: float, root: Path) -> None:
    """``<root>/stages/<stage>.json``, written (temp + rename) after the stage succeeded."""
    missing = [str(p) for p in stage.outputs if not p.exists()]
    if missing:
        raise RuntimeError(f"the {stage.name} stage exited 0 but did not write {missing}")
    record = {"stage": stage.name, "command": command_of(stage), "inputs": inputs,
              "outputs": {str(p): sha256_file(p) for p in stage.outputs},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "seconds": round(time.time() - started, 1), "git_sha": git_sha()}
    record_path(root, stage.name).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_path(root, stage.name), json.dumps(record, indent=2) + "\n")


def set_aside(stage: Stage, root: Path) -> None:
    """Before a stage reruns from scratch (changed inputs, ``force``): drop its record and move its
    folder to ``<folder>.prev`` (replacing an older one), so a new run never mixes with the old.
    Without a record the folder is a killed run's: kept (train resumes, capture continues)."""
    record = record_path(root, stage.name)
    if not record.is_file():
        return
    record.unlink()
    if stage.folder.exists():
        prev = stage.folder.with_name(stage.folder.name + ".prev")
        if prev.exists():
            remove_path(prev)
        os.replace(stage.folder, prev)


def run_stage(stage: Stage, log: Path, live: Live | None = None) -> int:
    """Run the stage's command, its output appended to ``log`` line by line (bars as their states:
    :class:`~dflash_lab.terminal.StageOutput`), progress lines shown by ``live``; its exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    command = command_of(stage)
    live = live or Live()
    with log.open("a") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        f.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PROGRESS_ENV: "1"}
        out = StageOutput(f)
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env)
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            while True:
                if sel.select(timeout=1.0):
                    data = os.read(child.stdout.fileno(), 65536)
                    if not data:
                        break
                    out.feed(data)
                live.show(out)
        out.close()
        live.clear()
        return child.wait()


class Live:
    """The running stage's one live line: redrawn in place on a terminal, else printed at most
    every ``every_s`` seconds (a CI log stays short)."""

    def __init__(self, every_s: float = 60.0, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s, self.started, self.shown = every_s, time.monotonic(), None

    def show(self, out: StageOutput) -> None:
        now = time.monotonic()
        line = "      " + out.status(now - self.started, now)
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + line[:width - 1] + "\033[K")
        elif self.shown is None or now - self.shown >= self.every_s:
            self.stream.write(line + "\n")
        else:
            return
        self.shown = now
        self.stream.flush()

    def clear(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def upstream(stages: list[Stage], stage: Stage) -> Stage | None:
    """The stage whose output ``stage`` reads: export for every eval, else the one before."""
    if stage.name == "eval" or stage.name.startswith(EVAL_PREFIX):
        return next(s for s in stages if s.name == "export")
    i = stages.index(stage)
    return stages[i - 1] if i else None


def check_selection(req: Request, stages: list[Stage]) -> list[Stage]:
    """The selected stages (``stages=``, else all), refusing one the recipe does not run, and a
    stage whose input folder is missing while the stage that writes it is not selected."""
    names = [s.name for s in stages]
    selected = req.stages if req.stages is not None else names
    for what, chosen in (("stages", selected), ("force", req.force)):
        bad = [n for n in chosen if n not in names]
        if bad:
            raise ValueError(f"{what}={chosen}: recipe {req.recipe} does not run the {bad[0]} "
                             f"stage; its stages are {names}")
    for stage in stages:
        before = upstream(stages, stage)
        if stage.name in selected and before and before.name not in selected:
            missing = [str(p) for p in before.outputs if not p.exists()]
            if missing:
                raise ValueError(f"the {stage.name} stage reads {missing[0]}, which the "
                                 f"{before.name} stage writes: run it too "
                                 f"(stages=[{before.name},{stage.name}])")
    return [s for s in stages if s.name in selected]


def run(req: Request) -> int:
    """Run (or skip) each selected stage in order; 0, or the exit code of the stage that failed."""
    stages = plan(req)
    todo = check_selection(req, stages)
    for number, stage in enumerate(todo, 1):
        before = upstream(stages, stage)
        inputs = inputs_of(stage, before, req.root)
        why = "forced" if stage.name in req.force else stale(stage, inputs, req.root)
        if why not in (None, NO_RECORD):
            print(f"{stage.name} reruns: {why}", flush=True)
        print(f"[{number}/{len(todo)}] {stage.name} ...", end=" ", flush=True)
        if why is None:
            print(f"skipped (done: {record_path(req.root, stage.name)})", flush=True)
            continue
        set_aside(stage, req.root)  # a record here is stale (or forced): start afresh
        started, log = time.time(), req.root / "logs" / f"{stage.name}.log"
        print(f"running (log: {log})", flush=True)
        code = run_stage(stage, log)
        print(f"[{number}/{len(todo)}] {stage.name} ...", end=" ", flush=True)
        if code != 0:
            print(f"failed (exit {code}) after {time.time() - started:.0f} s; log: {log}\n"
                  f"{log_tail(log, 15)}", flush=True)
            return code
        write_record(stage, inputs, started, req.root)
        print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


#: The stage commands that take ``recipe=NAME`` as "this stage of the recipe's pipeline"
#: (dflash-train's ``recipe=`` is its own standalone run: ``dflash-lab run stages=[train]``).
STAGE_COMMANDS = {"regenerate": "dflash-regenerate", "capture": "dflash-capture",
                  "export": "dflash-export", "eval": "dflash-eval"}


def stage_request(stage: str, argv: list[str]) -> Request:
    """``dflash-capture recipe=X [root=DIR] [OVERRIDE ...]`` -> ``dflash-lab run recipe=X
    [root=DIR] stages=[capture] capture:OVERRIDE ...``: the same arguments, folders, record and
    skip as the pipeline's stage. Export options are given bare (``--dtype=bfloat16``); an
    argument addressed to a stage (``train:KEY=VALUE``, whence all settings derive) passes as is."""
    if any(a.startswith(("stages=", "force=")) for a in argv):
        raise ValueError(f"{STAGE_COMMANDS[stage]} recipe=NAME runs the {stage} stage only: "
                         f"for stages=/force= use dflash-lab run\n{USAGE}")
    mine = [a for a in argv if a.startswith(("recipe=", "root="))]
    return parse_args(["run", *mine, f"stages=[{stage}]",
                       *(a if _is_routed(a) else f"{stage}:{a}" for a in argv if a not in mine)])


def _is_routed(arg: str) -> bool:
    """``train:KEY=VALUE`` etc.: addressed to a stage (all stages derive from the train config)."""
    prefix, sep, _ = arg.partition(":")
    return bool(sep) and "=" not in prefix and is_stage_name(prefix)


def stage_main(stage: str, argv: list[str]) -> int:
    """A stage command's entry on ``recipe=NAME`` (:func:`stage_request`); exit 2 as dflash-lab."""
    try:
        return run(stage_request(stage, argv))
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        print(f"{STAGE_COMMANDS[stage]}: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dflash-lab``); exit 2 on a bad command line or recipe."""
    argv = sys.argv[1:] if argv is None else list(argv)
    setup()
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n" + __doc__)
        return 0
    try:
        return run(parse_args(argv))
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        print(f"dflash-lab: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
