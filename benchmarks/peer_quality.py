"""Quality at equal budget (issues 20 and 27): our side of ``scripts/compare_speculators.py``.

Four subcommands, each a stage of the driver:

- ``plan``: compose the training config exactly as ``dflash-train`` does (same overrides), build
  its data module and write ``plan.json``: for every optimizer step the samples our trainer's
  loader serves (the data module's epoch-seeded sampler, ``data.batch_size`` per step, epochs
  chained until ``trainer.max_steps``), each as its shard file and token rows, and the lr our
  schedule gives that step; plus the drafter shape and the loss settings. speculators' side
  (``benchmarks/speculators_train.py``, its own venv) trains on exactly these batches.
- ``curves``: held-out tau (``dflash-eval mode=features``' simulator, the same function) of
  every saved checkpoint of every arm, ours (``.ckpt``: ``--ours`` and any ``--other
  SIDE=DIR``) and theirs (speculators directories, read by our importer) -> a TSV ``side step
  tau_mean acc_pos1 num_blocks path tau_T1`` (``tau_T1``: the exact expected acceptance length
  at T = 1 where the held-out capture holds the target distribution, DFlash 1; else None).
- ``table``: one seed's TSV and both final ``dflash-eval`` reports -> a markdown summary and the
  learning-curve plot (issue 20's form).
- ``summary``: every arm over every seed (``--run LABEL SIDE SEED CURVES EVAL_T0 EVAL_T1`` per
  arm and seed) -> mean, std and min..max over seeds of held-out tau at T = 0, held-out
  expected tau at T = 1, decoding tau at T = 0 and T = 1 and losslessness, whether each of our
  arms is separated from theirs by more than the seed spread, the mean learning curves, and
  their plot (mean line, min..max band).

    python -m benchmarks.peer_quality plan --out PLAN.json -- OVERRIDE ...
    python -m benchmarks.peer_quality curves --heldout CAPTURE --target TARGET --ours DIR \
        --theirs DIR --out CURVES.tsv
    python -m benchmarks.peer_quality table --curves CURVES.tsv --eval-ours REPORT.json \
        --eval-theirs REPORT.json --out SUMMARY.md --plot PNG
    python -m benchmarks.peer_quality summary --step N --heldout CAPTURE --variant dflash1 \
        --run LABEL SIDE SEED CURVES.tsv T0_REPORT.json T1_REPORT.json [--run ...] \
        --out SUMMARY.md --plot PNG
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_lab.model import heads
from dflash_lab.paths import atomic_path, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"


# ------------------------------------------------------------------------------------ plan
def compose_train(overrides: list[str]):
    """The config ``dflash-train OVERRIDES`` runs with (conf/train.yaml)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def sample_rows(capture_dir: str | Path) -> list[tuple[str, int, int]]:
    """(shard file name, first row, end row) of every captured sample, in the order
    :class:`~dflash_lab.data.shards.ShardDataset` indexes them (shards in manifest order,
    samples in offset order)."""
    from safetensors import safe_open

    from dflash_lab.data.shards import read_manifest

    root = Path(capture_dir)
    rows = []
    for rec in read_manifest(root)["shards"]:
        with safe_open(str(root / rec["file"]), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
        rows += [(rec["file"], a, b) for a, b in zip(offsets[:-1], offsets[1:])]
    return rows


def step_batches(data, num_steps: int) -> list[list[int]]:
    """Dataset indices (into the whole capture) of the batch of each of the first ``num_steps``
    optimizer steps, as our trainer's loader serves them: epoch e's order is the train loader's
    sampler after ``set_epoch(e)`` (Lightning calls it at every epoch start), cut into
    ``batch_size`` batches, the last one short (the loader does not drop it)."""
    loader = data.train_dataloader()
    train_indices = list(data.train_set.indices)
    steps: list[list[int]] = []
    epoch = 0
    while len(steps) < num_steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader.batch_sampler:
            steps.append([train_indices[i] for i in batch])
            if len(steps) == num_steps:
                break
        epoch += 1
    return steps


def schedule_lrs(cfg, num_steps: int) -> list[float]:
    """The lr of optimizer steps 0..num_steps-1 under the run's optimizer and scheduler config
    (the scheduler built by the same partials ``DFlashModule.configure_optimizers`` uses, with
    ``total_steps`` = the run's step budget)."""
    from hydra.utils import instantiate

    param = torch.nn.Parameter(torch.zeros(1))
    opt = instantiate(cfg.module.optimizer)([("weight", param)])  # named, as configure_optimizers
    sched = instantiate(cfg.module.scheduler)(opt, total_steps=num_steps)
    lrs = []
    for _ in range(num_steps):
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return lrs


def variant_fields(dc) -> dict[str, Any]:
    """The plan drafter's variant, its head's declared fields (``Head.fields``: DFlash 2's conv
    and selector shape, DSpark's Markov and confidence heads, Domino's GRU, LiLiCorr's lattice
    and conv, XPress's refiner) and ``sample_from_anchor`` (speculators' drafter is built with
    the same values)."""
    return {"variant": dc.variant, **{k: getattr(dc, k) for k in dc.head.fields},
            "sample_from_anchor": bool(dc.sample_from_anchor)}


def build_plan(overrides: list[str]) -> dict[str, Any]:
    """plan.json's content for the run ``dflash-train OVERRIDES`` (needs trainer.max_steps)."""
    from hydra.utils import instantiate

    cfg = compose_train(overrides)
    num_steps = int(cfg.trainer.max_steps)
    if num_steps < 1:
        raise ValueError(f"trainer.max_steps={num_steps}: the plan needs a step budget "
                         "(trainer.max_steps=N among the overrides)")
    target = instantiate(cfg.target)
    drafter = instantiate(cfg.drafter, _partial_=True)(target=target)
    dc = drafter.config
    data = instantiate(cfg.data, _partial_=True)(
        target=target, target_layer_ids=dc.target_layer_ids, hidden_size=dc.hidden_size,
        vocab_size=dc.vocab_size)
    data.setup("fit")  # as dflash-train's build_components: target, drafter, then data
    rows = sample_rows(cfg.data.path)
    batches = step_batches(data, num_steps)
    opt = cfg.module.optimizer
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return {
        "capture": str(Path(cfg.data.path).resolve()),
        "overrides": list(overrides),
        "num_steps": num_steps,
        "batch_size": int(cfg.data.batch_size),
        "num_anchors_per_sequence": int(cfg.module.num_anchors),
        "gamma": float(cfg.module.gamma),
        "gradient_clip_val": float(cfg.trainer.gradient_clip_val),
        "optimizer": {"lr": float(opt.lr), "betas": [float(b) for b in opt.betas],
                      "weight_decay": float(opt.weight_decay)},
        "drafter": {"num_hidden_layers": dc.num_hidden_layers, "block_size": dc.block_size,
                    "target_layer_ids": list(dc.target_layer_ids),
                    "mask_token_id": dc.mask_token_id, "hidden_size": dc.hidden_size,
                    "vocab_size": dc.vocab_size, "trainable_params": trainable,
                    **variant_fields(dc)},
        "steps": [{"samples": b, "rows": [list(rows[i]) for i in b], "lr": lr}
                  for b, lr in zip(batches, schedule_lrs(cfg, num_steps))],
    }


# ---------------------------------------------------------------------------------- curves
#: the side names of the peers' saves in a curves TSV (benchmarks/speculators_train.py's,
#: benchmarks/modelopt_train.py's, benchmarks/specforge_train.py's)
THEIR_SIDES = ("speculators", "modelopt", "specforge")


def checkpoints(ours: str | Path, theirs: str | Path,
                others: dict[str, str | Path] | None = None,
                theirs_side: str = "speculators") -> list[tuple[str, int, Path]]:
    """(side, step, path) of every saved checkpoint: ours ``stepN.ckpt`` files (side ``ours``,
    and each ``others`` side: another of our runs, e.g. the distribution-loss arm), theirs
    ``step-N`` directories (side ``theirs_side``: speculators, modelopt or specforge), by side then
    step."""
    found = []
    ours_sides = {"ours": ours, **(others or {})}
    for side, root in ours_sides.items():
        for p in Path(root).glob("step*.ckpt"):
            m = re.fullmatch(r"step(\d+)\.ckpt", p.name)
            if m:
                found.append((side, int(m.group(1)), p))
    for p in Path(theirs).glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and (p / "config.json").is_file():
            found.append((theirs_side, int(m.group(1)), p))
    if not found:
        dirs = ", ".join(str(d) for d in ours_sides.values())
        raise ValueError(f"no checkpoints under {dirs} (stepN.ckpt) or {theirs} (step-N/): "
                         "run the train_ours and train_theirs stages first")
    return sorted(found, key=lambda t: (t[0], t[1]))


def curve_rows(heldout: str, target_path: str, ours: str, theirs: str,
               num_anchors: int | None = None,
               done: list[dict[str, Any]] | None = None,
               others: dict[str, str] | None = None,
               theirs_side: str = "speculators") -> list[dict[str, Any]]:
    """Held-out tau of every checkpoint, the target loaded once (float32, as dflash-eval).
    ``done``: rows of an earlier pass (same settings), kept; only checkpoints without a row
    are evaluated, so the stage can run while the other side is still training. ``others``:
    more of our runs by side name (:func:`checkpoints`). ``tau_T1``: features mode's expected
    acceptance length at T = 1 (reported where the held-out capture holds the target
    distribution and the drafter is DFlash 1), else None."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from dflash_lab.data.shards import ShardDataset, read_manifest
    from dflash_lab.eval.loading import check_pair, load_drafter
    from dflash_lab.eval.offline_tau import feature_eval

    read_manifest(heldout)  # a ValueError naming the directory before the target loads

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[
            "target=hf", f"target.name_or_path={target_path}", "target.dtype=float32",
            "target.device=cpu"])
    target = instantiate(cfg.target)
    rows = list(done or [])
    have = {(r["side"], r["step"]) for r in rows}
    dataset = None
    for side, step, path in checkpoints(ours, theirs, others, theirs_side):
        if (side, step) in have:
            continue
        loaded = load_drafter(path, backend="sdpa", device=target.device,
                              dtype=target.model.dtype)
        check_pair(loaded.drafter, target, loaded.depth_recorded)
        dc = loaded.drafter.config
        if dataset is None:
            dataset = ShardDataset(heldout, target_layer_ids=dc.target_layer_ids,
                                   hidden_size=dc.hidden_size, vocab_size=dc.vocab_size,
                                   target=target.identity())
        rep = feature_eval(loaded.drafter, target.pieces(), dataset, num_anchors=num_anchors,
                           progress=False)
        rows.append({"side": side, "step": step, "tau_mean": rep["tau_mean"],
                     "acc_pos1": rep["per_position_acceptance"][0],
                     "num_blocks": rep["num_blocks"], "path": str(path),
                     "tau_T1": rep.get("tau_T1")})
        print(json.dumps(rows[-1]), flush=True)
    return sorted(rows, key=lambda r: (r["side"], r["step"]))


def write_tsv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    text = "\t".join(keys) + "\n" + "".join(
        "\t".join(str(r[k]) for k in keys) + "\n" for r in rows)
    atomic_write_text(Path(path), text)


def _float_or_none(text: str | None) -> float | None:
    return None if text in (None, "", "None") else float(text)


def read_tsv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a curves TSV; ``tau_T1`` None where the row has none (also in TSVs written
    before the column existed, so their rows keep merging with new ones)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for r in rows:
        r["step"], r["tau_mean"] = int(r["step"]), float(r["tau_mean"])
        r["acc_pos1"], r["num_blocks"] = float(r["acc_pos1"]), int(r["num_blocks"])
        r["tau_T1"] = _float_or_none(r.get("tau_T1"))
    return rows


# ----------------------------------------------------------------------------------- table
def curve_table(rows: list[dict[str, Any]]) -> list[tuple[int, float | None, float | None]]:
    """(step, our tau, their tau) for every step either side saved (None where a side has no
    checkpoint at that step), by step."""
    by = {(r["side"], r["step"]): r["tau_mean"] for r in rows}
    steps = sorted({r["step"] for r in rows})
    return [(s, by.get(("ours", s)), by.get(("speculators", s))) for s in steps]


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def summary_markdown(rows: list[dict[str, Any]], eval_ours: dict, eval_theirs: dict) -> str:
    """The learning-curve table and the final eval table (markdown)."""
    lines = ["| step | ours: held-out tau (features) | speculators: held-out tau | ours - theirs |",
             "|---|---|---|---|"]
    for step, a, b in curve_table(rows):
        diff = None if a is None or b is None else a - b
        lines.append(f"| {step} | {_fmt(a)} | {_fmt(b)} | {_fmt(diff)} |")
    lines += ["", "| drafter | tau (generate) | lossless | verify rounds | acceptance t=1 | "
              "speedup |", "|---|---|---|---|---|---|"]
    for name, rep in (("ours", eval_ours), ("speculators", eval_theirs)):
        pos = rep.get("per_position_acceptance") or [None]
        lines.append(f"| {name} | {_fmt(rep.get('tau_mean'))} | {rep.get('lossless')} | "
                     f"{rep.get('num_rounds')} | {_fmt(pos[0])} | "
                     f"{_fmt(rep.get('speedup'), 2)}x |")
    same = eval_ours.get("prompt_ids") == eval_theirs.get("prompt_ids")
    lines += ["", f"Same prompt token ids in both evals: {'yes' if same else 'NO'}; "
              f"{eval_ours.get('num_prompts')} prompts, "
              f"{eval_ours.get('num_output_tokens')} / {eval_theirs.get('num_output_tokens')} "
              "output tokens."]
    return "\n".join(lines) + "\n"


#: The plot's default title: the SmolLM2 recipe's drafter shape.
PLOT_TITLE = "SmolLM2-135M + ShareGPT, 3 layers, B=8"


def plot_curves(rows: list[dict[str, Any]], png: str | Path, title: str = PLOT_TITLE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side, style in (("ours", "o-"), ("speculators", "s--")):
        pts = sorted((r["step"], r["tau_mean"]) for r in rows if r["side"] == side)
        if pts:
            ax.plot(*zip(*pts), style, label="dflash-lab" if side == "ours"
                    else "speculators 0.9.0")
    _finish_plot(fig, ax, "held-out tau (features mode)", title, png)


def _finish_plot(fig, ax, ylabel: str, title: str, png: str | Path) -> None:
    """Label, grid and legend a learning-curve plot, then write it (temporary name, rename)."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("optimizer steps (same batches)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(Path(png)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------- summary
#: The summary's measures per arm and seed: (key, column title).
MEASURES = (("heldout_T0", "held-out tau, T=0"),
            ("heldout_T1", "held-out expected tau, T=1"),
            ("decode_T0", "decoding tau, T=0"),
            ("decode_T1", "decoding tau, T=1"))


@dataclass(frozen=True)
class SeedRun:
    """One arm at one seed: its label in the tables, its side in the curves TSV, the seed, the
    TSV, and its final drafter's dflash-eval reports at T = 0 and T = 1."""

    label: str
    side: str
    seed: int
    curves: Path
    eval_t0: Path
    eval_t1: Path


def _read_json(path: Path, missing: list[str]) -> dict | None:
    if not path.is_file():
        missing.append(str(path))
        return None
    return json.loads(path.read_text())


def seed_values(run: SeedRun, step: int, missing: list[str]) -> dict[str, Any]:
    """The measures of one arm at one seed (:data:`MEASURES`; None where not measured) plus
    ``lossless_T0`` and the arm's learning curve ``curve`` {step: tau}; every input file that
    does not exist is appended to ``missing`` (the table names them: no silent gaps)."""
    rows: list[dict[str, Any]] = []
    if run.curves.is_file():
        rows = [r for r in read_tsv(run.curves) if r["side"] == run.side]
    else:
        missing.append(str(run.curves))
    final = next((r for r in rows if r["step"] == step), None)
    if run.curves.is_file() and final is None:
        missing.append(f"{run.curves}: no {run.side} row at step {step}")
    t0 = _read_json(run.eval_t0, missing)
    t1 = _read_json(run.eval_t1, missing)
    return {"heldout_T0": final and final["tau_mean"],
            "heldout_T1": final and final["tau_T1"],
            "decode_T0": t0 and t0.get("tau_mean"),
            "decode_T1": t1 and t1.get("tau_mean"),
            "lossless_T0": t0 and t0.get("lossless"),
            "t1_settings": t1 and {k: t1.get("settings", {}).get(k)
                                   for k in ("temperature", "sampling")},
            "curve": {r["step"]: r["tau_mean"] for r in rows}}


def spread(values: list[float]) -> dict[str, float] | None:
    """mean, std (sample, ddof 1; 0 for one value), min, max and n of ``values``; None when
    empty."""
    if not values:
        return None
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def _cell(st: dict[str, float] | None, of: int, why: str) -> str:
    if st is None:
        return why
    text = (f"{st['mean']:.3f}" if st["n"] == 1 else
            f"{st['mean']:.3f} ± {st['std']:.3f} [{st['min']:.3f}..{st['max']:.3f}]")
    return text + ("" if st["n"] == of else f" ({st['n']} of {of} seeds)")


def t1_reason(variant: str, heldout_holds: bool) -> str:
    """Why the held-out expected tau at T = 1 is not there, in the words the table shows."""
    head = heads.get(variant.removesuffix("_conv"))  # lilicorr_conv: the lilicorr head
    if head.walk:
        return (f"n/a ({head.title} drafts from its {head.walk}: features mode measures tau_T1 "
                "for DFlash 1 only; see decoding T=1)")
    if not heldout_holds:
        return ("n/a (needs a held-out capture with capture.distribution=[last_hidden]: "
                "distribution=last_hidden)")
    return "n/a (needs features-mode tau_T1 in the curves: rerun the curves stage)"


def separation(a: dict[str, float] | None, b: dict[str, float] | None) -> str:
    """Whether two arms' seed ranges are apart: the difference of their means and a verdict."""
    if a is None or b is None:
        return "-"
    diff = f"{a['mean'] - b['mean']:+.3f}"
    if a["n"] < 2 or b["n"] < 2:
        return f"{diff} (one seed: spread unknown)"
    apart = a["min"] > b["max"] or a["max"] < b["min"]
    verdict = "separated: the seed ranges do not overlap" if apart else "within the seed spread"
    return f"{diff} ({verdict})"


def summarize(runs: list[SeedRun], step: int, variant: str, heldout_holds: bool,
              theirs_label: str = "speculators") -> tuple[str, dict[str, Any]]:
    """The summary markdown and its numbers (``{label: {measure: spread}}``, curves).

    Per arm (label, in the order first given): every measure's :func:`spread` over its seeds,
    losslessness at T = 0 (every seed's eval), the arm against ``theirs_label`` per measure
    (:func:`separation`), then the mean learning curve per step."""
    missing: list[str] = []
    labels = list(dict.fromkeys(r.label for r in runs))
    seeds = {lab: sorted(r.seed for r in runs if r.label == lab) for lab in labels}
    values = {lab: [seed_values(r, step, missing) for r in runs if r.label == lab]
              for lab in labels}
    stats = {lab: {k: spread([v[k] for v in vals if v[k] is not None]) for k, _ in MEASURES}
             for lab, vals in values.items()}
    why = {"heldout_T1": t1_reason(variant, heldout_holds)}
    lines = [f"Final drafters (step {step}); each cell: mean ± std [min..max] over the seeds "
             "(one value: one seed).", "",
             "| arm | seeds | " + " | ".join(t for _, t in MEASURES) + " | lossless T=0 | "
             "lossless T=1 |", "|---" * (len(MEASURES) + 4) + "|"]
    for lab in labels:
        of = len(seeds[lab])
        cells = [_cell(stats[lab][k], of, why.get(k, "missing (run its stage)"))
                 for k, _ in MEASURES]
        checked = [v["lossless_T0"] for v in values[lab] if v["lossless_T0"] is not None]
        lossless = ("-" if not checked else
                    f"{'yes' if all(checked) else 'NO'} ({sum(map(bool, checked))}/{of})")
        lines.append(f"| {lab} | {' '.join(map(str, seeds[lab]))} | {' | '.join(cells)} | "
                     f"{lossless} | in distribution (rejection sampling) |")
    if theirs_label in stats:
        lines += ["", f"Against {theirs_label} (difference of the means; separated when the "
                  "min..max ranges over seeds do not overlap):", "",
                  "| arm | " + " | ".join(t for _, t in MEASURES) + " |",
                  "|---" * (len(MEASURES) + 1) + "|"]
        for lab in labels:
            if lab != theirs_label:
                lines.append(f"| {lab} - {theirs_label} | " + " | ".join(
                    separation(stats[lab][k], stats[theirs_label][k]) for k, _ in MEASURES)
                    + " |")
    curves = {lab: _mean_curve(values[lab]) for lab in labels}
    steps = sorted({s for c in curves.values() for s in c})
    lines += ["", "Held-out tau (T=0) along training, mean over the seeds [min..max]:", "",
              "| step | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(
            _cell(curves[lab].get(s), len(seeds[lab]), "-") for lab in labels) + " |")
    t1 = {json.dumps(v["t1_settings"], sort_keys=True) for vals in values.values()
          for v in vals if v["t1_settings"]}
    if t1:
        lines += ["", "Decoding at T=1 ran with " + "; ".join(sorted(t1)) + "."]
    if missing:
        lines += ["", "Missing inputs (their cells show missing or fewer seeds):", ""]
        lines += [f"- {m}" for m in missing]
    return "\n".join(lines) + "\n", {"stats": stats, "curves": curves, "missing": missing}


def _mean_curve(vals: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    steps = sorted({s for v in vals for s in v["curve"]})
    return {s: spread([v["curve"][s] for v in vals if s in v["curve"]]) for s in steps}


def plot_seed_curves(curves: dict[str, dict[int, dict[str, float]]], png: str | Path,
                     title: str = PLOT_TITLE, theirs_label: str = "speculators") -> None:
    """Mean held-out tau per step of every arm, with its min..max band over the seeds (the
    peer's arm, ``theirs_label``, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for lab, curve in curves.items():
        if not curve:
            continue
        steps = sorted(curve)
        mean = [curve[s]["mean"] for s in steps]
        (line,) = ax.plot(steps, mean, "s--" if lab == theirs_label else "o-", label=lab)
        ax.fill_between(steps, [curve[s]["min"] for s in steps],
                        [curve[s]["max"] for s in steps], color=line.get_color(), alpha=0.15)
    _finish_plot(fig, ax, "held-out tau, T=0 (mean, min..max over seeds)", title, png)


# ------------------------------------------------------------------------------------- cli
def parse_others(items: list[str]) -> dict[str, str]:
    """``--other SIDE=DIR`` values as {side: dir}; ValueError naming a malformed one."""
    out = {}
    for item in items:
        side, sep, root = item.partition("=")
        if not sep or not side or not root or side in ("ours", *THEIR_SIDES):
            raise ValueError(f"--other {item!r}: expected SIDE=DIR with a side name other than "
                             f"ours and {' and '.join(THEIR_SIDES)}, e.g. --other "
                             "ours-loss-kl1.0=RUN/curve")
        out[side] = root
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan")
    pp.add_argument("--out", required=True)
    pp.add_argument("overrides", nargs="*")
    pc = sub.add_parser("curves")
    for k in ("heldout", "target", "ours", "theirs", "out"):
        pc.add_argument(f"--{k}", required=True)
    pc.add_argument("--num-anchors", type=int, default=None,
                    help="blocks per held-out sample (default: every valid anchor)")
    pc.add_argument("--theirs-side", default="speculators", choices=list(THEIR_SIDES),
                    help="the side name of --theirs' step-N saves (their trainer)")
    pc.add_argument("--other", action="append", default=[], metavar="SIDE=DIR",
                    help="another of our runs' stepN.ckpt directory, scored as side SIDE")
    pt = sub.add_parser("table")
    for k in ("curves", "eval-ours", "eval-theirs", "out", "plot"):
        pt.add_argument(f"--{k}", required=True)
    pt.add_argument("--title", default=PLOT_TITLE, help="the plot's title")
    ps = sub.add_parser("summary")
    ps.add_argument("--run", action="append", nargs=6, required=True,
                    metavar=("LABEL", "SIDE", "SEED", "CURVES", "EVAL_T0", "EVAL_T1"),
                    help="one arm at one seed (repeat for every arm and seed)")
    ps.add_argument("--step", type=int, required=True, help="the final drafters' step")
    ps.add_argument("--heldout", required=True, help="the held-out capture of the curves")
    ps.add_argument("--variant", default="dflash1", choices=[*heads.names(), "lilicorr_conv"])
    for k in ("out", "plot"):
        ps.add_argument(f"--{k}", required=True)
    ps.add_argument("--json", default=None, help="also write the numbers here")
    ps.add_argument("--theirs-label", default="speculators",
                    help="the peer arm's label (ModelOpt for variant=lilicorr|lilicorr_conv)")
    ps.add_argument("--title", default=PLOT_TITLE, help="the plot's title")
    a = p.parse_args(argv)
    if a.cmd == "plan":
        plan = build_plan(a.overrides)
        atomic_write_text(Path(a.out), json.dumps(plan) + "\n")
        print(f"plan: {plan['num_steps']} steps of {plan['batch_size']} sequences -> {a.out}")
    elif a.cmd == "curves":
        done = read_tsv(a.out) if Path(a.out).is_file() else None
        write_tsv(a.out, curve_rows(a.heldout, a.target, a.ours, a.theirs, a.num_anchors, done,
                                    parse_others(a.other), a.theirs_side))
    elif a.cmd == "summary":
        from dflash_lab.data.shards import distribution_of, read_manifest

        runs = [SeedRun(lab, side, int(seed), Path(c), Path(e0), Path(e1))
                for lab, side, seed, c, e0, e1 in a.run]
        holds = distribution_of(read_manifest(a.heldout))["last_hidden"]
        text, numbers = summarize(runs, a.step, a.variant, holds, a.theirs_label)
        atomic_write_text(Path(a.out), text)
        if a.json:
            atomic_write_text(Path(a.json), json.dumps(numbers, indent=1) + "\n")
        plot_seed_curves(numbers["curves"], a.plot, a.title, a.theirs_label)
    else:
        rows = read_tsv(a.curves)
        reports = [json.loads(Path(x).read_text()) for x in (a.eval_ours, a.eval_theirs)]
        atomic_write_text(Path(a.out), summary_markdown(rows, *reports))
        plot_curves(rows, a.plot, a.title)


if __name__ == "__main__":
    main()
