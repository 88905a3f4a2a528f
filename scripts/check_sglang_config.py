"""`make check-sglang-config`: SGLang's own config-level code against every shipped recipe's export.

For each recipe in recipes/*.yaml (DFlash 1 and DFlash 2, plus the z-lab layout with scales and
the Muse Glimmer drafters exported ``--format muse-glimmer``, :data:`FORMATS`) the
exporter's config.json is written from the golden export config of its layout
(tests/export/golden/export_config, which tests/export/test_golden.py pins to the recipe as
composed), at the recipe's real depth, vocab and layer layout. ``scripts/sglang_config_worker.py``
then runs, in the SGLang venv (``make sglang-venv``, sglang 0.5.23), SGLang's own
``models/dflash.py::_get_dflash_layer_attention_params`` per layer and
``speculative/dflash_utils.py::parse_dflash_draft_config``, plus what decides the mask embedding
(``DFlashWorkerV2._maybe_merge_trained_mask_embedding``), the sinks (DFlashAttention) and the
block-input scale (the target class's embedding module and DFlash hooks).

Verdict per export: SGLang's reading equals the trained layout and features (per-layer window and
causality, sinks, learned mask embedding, input embedding scale, output multiplier, soft-cap,
value scale, DFlash 2 class, conv and selector fields), or the exporter
(:func:`dflash_lab.export.plan_export` with ``engines=("sglang",)``, the
``dflash-export --engine sglang`` decision) refused SGLang for that export. Anything else fails
with the field-by-field diff.

Config-level code cannot show how a draft attention backend bounds the right side of a
bidirectional sliding window (export/engines/sglang.py ``BACKENDS`` models that per backend): such
layers compare window and causality only, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash_lab.export import plan_export
from dflash_lab.export.api import OURS, format_config
from dflash_lab.export.checks import refusals
from dflash_lab.export.engines import SGLANG_BACKENDS
from dflash_lab.export.engines.sglang import DEFAULT_RELEASE
from dflash_lab.model.config import DrafterConfig
from dflash_lab.paths import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "export" / "golden" / "export_config"
WORKER = ROOT / "scripts" / "sglang_config_worker.py"
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
OUT = ROOT / "outputs" / "check_sglang_config"
SGLANG_VERSION = DEFAULT_RELEASE  # the release the exporter's rules emulate (Makefile pin)

#: Domino's keys SGLang's parser reads (None for any other head: it reads them for Domino only)
DOMINO_KEYS = ("projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim",
               "emb_dim")
#: LiLiCorr's keys SGLang's ``_parse_lilicorr_config`` reads (None: it builds no LiLiCorr head)
LILICORR_KEYS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
                 "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
                 "lilicorr_vector_eps", "lilicorr_logit_scale")
#: recipe -> (golden layout it exports, the SGLang class of its target). The classes are the
#: published checkpoints' ``architectures[0]`` (tests/tiny_archs.py builds each); the built-in
#: tiny target is a Qwen3 model. finetune_cpu warm-starts from the demo's export: tiny_cpu's
#: layout. A recipe missing here fails the check (add its row).
RECIPES: dict[str, tuple[str, str]] = {
    "tiny_cpu": ("tiny_cpu", "Qwen3ForCausalLM"),
    "tiny_cpu_swa": ("tiny_cpu_swa", "Qwen3ForCausalLM"),
    "tiny_cpu_dflash2": ("tiny_cpu_dflash2", "Qwen3ForCausalLM"),
    "tiny_cpu_domino": ("tiny_cpu_domino", "Qwen3ForCausalLM"),
    "tiny_cpu_lilicorr": ("tiny_cpu_lilicorr", "Qwen3ForCausalLM"),
    "tiny_cpu_lilicorr_conv": ("tiny_cpu_lilicorr_conv", "Qwen3ForCausalLM"),
    "finetune_cpu": ("tiny_cpu", "Qwen3ForCausalLM"),
    "qwen3_8b_b16": ("qwen3_8b_b16", "Qwen3ForCausalLM"),
    "smollm2_sharegpt_cpu": ("smollm2_sharegpt_cpu", "LlamaForCausalLM"),
    "smollm2_10min": ("smollm2_sharegpt_cpu", "LlamaForCausalLM"),  # the same drafter
    "smollm2_sharegpt_cpu_onpolicy": ("smollm2_sharegpt_cpu_onpolicy", "LlamaForCausalLM"),
    "smollm2_ctxlen_full": ("smollm2_ctxlen_full", "LlamaForCausalLM"),
    "smollm2_ctxlen_sliding": ("smollm2_ctxlen_sliding", "LlamaForCausalLM"),
    "gemma4_swa": ("gemma4_swa", "Gemma4ForConditionalGeneration"),
    "qwen3.6_27b_swa": ("qwen3.6_27b_swa", "Qwen3_5ForConditionalGeneration"),
    "qwen3.8_27b_dflash2": ("qwen3.8_27b_dflash2", "Qwen3_5ForConditionalGeneration"),
    "mimo_swa_sinks": ("mimo_swa_sinks", "MiMoV2FlashForCausalLM"),
}
#: recipes whose export SGLang cannot load, so the exporter refuses SGLang for them (checked by
#: :func:`refused_rows` without the SGLang venv): recipe -> golden layout
SGLANG_REFUSED: dict[str, str] = {
    "tiny_cpu_dspark": "tiny_cpu_dspark",  # vLLM's speculators DSpark layout (export/dspark.py)
    "tiny_cpu_xpress": "tiny_cpu_xpress",  # Qwen3XPressModel: vLLM 0.34 only (docs/xpress.md)
}
#: layouts checked besides the recipes: z-lab's DFlash 2 layout with all three scales, and the
#: Muse Glimmer drafters at the released sizes (z-lab/Muse-Glimmer-30B-DFlash2's config: every
#: layer sliding W=2048 bidirectional), for the Muse Glimmer target's class
EXTRA = {"zlab_layout_dflash2_scales": ("zlab_layout_dflash2_scales", "Qwen3ForCausalLM"),
         "muse_glimmer_dflash1": ("muse_glimmer_dflash1", "MuseGlimmerForConditionalGeneration"),
         "muse_glimmer_dflash2": ("muse_glimmer_dflash2", "MuseGlimmerForConditionalGeneration")}
#: rows exported in another ``--format`` than ours (export/api.py ``format_config``): the
#: assistant's layout (MuseGlimmerAssistantModel, SGLang's MuseGlimmerAssistantConfig) for
#: DFlash 1, the released DFlash 2 Muse layout (DFlash2DraftModel) for DFlash 2
FORMATS = {"muse_glimmer_dflash1": "muse-glimmer", "muse_glimmer_dflash2": "muse-glimmer"}


def exports(recipes_dir: Path = ROOT / "recipes") -> dict[str, tuple[DrafterConfig, str]]:
    """name -> (the drafter config its export writes, target class), every shipped recipe."""
    names = sorted(p.stem for p in recipes_dir.glob("*.yaml"))
    missing = [n for n in names if n not in RECIPES and n not in SGLANG_REFUSED]
    if missing:
        raise ValueError(f"recipes {missing} (recipes/*.yaml) have no row in RECIPES of "
                         f"{Path(__file__).name}: add (golden layout, target class) for each")
    rows = {n: RECIPES[n] for n in names if n in RECIPES} | EXTRA
    out = {}
    for name, (layout, arch) in rows.items():
        path = GOLDEN / f"{layout}.json"
        out[name] = (DrafterConfig.from_dict(json.loads(path.read_text()), source=str(path)),
                     arch)
    return out


def refused_rows() -> dict[str, list[str]]:
    """recipe -> the exporter's SGLang refusals of its golden export (each must have one)."""
    from dflash_lab.export.formats.dspark import read_config as speculators_config

    out = {}
    for name, layout in SGLANG_REFUSED.items():
        path = GOLDEN / f"{layout}.json"
        raw = json.loads(path.read_text())  # ours (XPress) or the speculators DSpark layout
        config = (DrafterConfig.from_dict(raw, source=str(path)) if "dflash_config" in raw
                  else speculators_config(raw, path)[0])
        _, findings = plan_export(config, ("sglang",))
        out[name] = [f.message for f in refusals(findings)]
    return out


def written(name: str, config: DrafterConfig) -> dict[str, Any]:
    """The config.json the exporter writes for row ``name`` (its ``--format``, :data:`FORMATS`)."""
    return format_config(FORMATS.get(name, OURS), config, "bfloat16", None, vocab_known=True)


def trained(config: DrafterConfig, architecture: str | None = None) -> dict[str, Any]:
    """What the drafter was trained with, in the terms SGLang's code reads (``architecture``:
    the one its export declares, default our format's)."""
    return {
        "layers": [[s.window, s.causal] for s in config.layer_specs()],
        "architecture": architecture or config.to_dict()["architectures"][0],
        "num_hidden_layers": config.num_hidden_layers, "block_size": config.block_size,
        "mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers,
        "sinks": config.attention_sink_bias, "mask_embedding": config.learned_mask_embedding,
        "input_embedding_scale": config.input_embedding_scale,
        "output_multiplier": config.output_multiplier,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attention_value_scale": None,
        "conv_kernel_size": config.conv_kernel_size or 0,
        "conv_group_size": config.conv_group_size or 0,
        "selector_rank": config.selector_rank or 0, "selector_top_k": config.selector_top_k or 0,
        **{k: config.head_options.get(k) for k in (*DOMINO_KEYS, *LILICORR_KEYS)},
    }


def _errors(result: dict[str, Any]) -> list[str]:
    return [f"{part}: {v['error']}" for part, v in result.items() if "error" in v]


def _fed_scale(target: dict[str, Any]) -> tuple[float | None, str | None]:
    """(scale SGLang feeds block inputs with, or None and why it cannot be known / raises)."""
    if not target["capture_hook"]:
        return None, "the target class has no set_dflash_layers_to_capture: SGLang raises"
    if target["noise_scale_hook"]:
        return None, "the target class defines get_dflash_noise_embedding_scale (not read here)"
    if target["embedding_scale"] is None:
        return None, "the target's scaled embedding module uses a scale this check cannot read"
    return float(target["embedding_scale"]), None


def sglang_reading(result: dict[str, Any], shipped_mask: bool) -> tuple[dict | None, list[str]]:
    """The worker's output for one export, in :func:`trained`'s terms; or (None, why SGLang
    refuses or the reading is incomplete). ``shipped_mask``: mask_embedding.pt is in the export."""
    errors = _errors(result)
    if errors:
        return None, errors
    draft, model = result["draft"]["value"], result["model_class"]["value"]
    lilicorr = result["lilicorr"]["value"] or dict.fromkeys(LILICORR_KEYS)
    scale, why = _fed_scale(result["target"]["value"])
    if not model["known"]:
        return None, [f"architectures[0]={model['architecture']!r} is none of SGLang's DFlash "
                      f"classes {model['entry_classes']}"]
    if why:
        return None, [why]
    layers = [[None if wl < 0 else wl + 1, kind == "DECODER"]
              for wl, kind in result["layers"]["value"]]
    return {
        "layers": layers, "architecture": model["architecture"],
        **{k: draft[k] for k in ("num_hidden_layers", "block_size", "mask_token_id",
                                 "target_layer_ids", "num_target_layers", "output_multiplier",
                                 "final_logit_softcapping", "attention_value_scale",
                                 "conv_kernel_size", "conv_group_size", "selector_rank",
                                 "selector_top_k", *DOMINO_KEYS)},
        "sinks": bool(draft["attention_sink_bias"] and result["sinks_built"]["value"]),
        "mask_embedding": bool(shipped_mask and result["merges_mask"]["value"]),
        "input_embedding_scale": scale, **lilicorr,
    }, []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def diff(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """``field: trained X, SGLang Y`` for every field (and layer) that differs."""
    lines = []
    for key, value in want.items():
        if key == "layers":
            lines += [f"layer {i}: trained {_label(w)}, SGLang {_label(g)}"
                      for i, (w, g) in enumerate(zip(value, got["layers"])) if w != g]
            if len(value) != len(got["layers"]):
                lines.append(f"layers: trained {len(value)}, SGLang {len(got['layers'])}")
        elif not _same(value, got.get(key)):
            lines.append(f"{key}: trained {value!r}, SGLang {got.get(key)!r}")
    return lines


def _label(layer: list) -> str:
    window, causal = layer
    return f"{'full' if window is None else f'W={window}'} {'causal' if causal else 'bidir'}"


def verdict(config: DrafterConfig, arch: str, result: dict[str, Any],
            refused: dict[str, list[str]], architecture: str | None = None) -> dict[str, Any]:
    """PASS when SGLang reads the export as trained, or the exporter refuses SGLang for it under
    EVERY ``--sglang_attention_backend`` choice (``refused``: choice -> the exporter's refusal
    messages, empty = it exports for SGLang with that choice; ``architecture``: the export's)."""
    want = trained(config, architecture)
    got, problems = sglang_reading(result, shipped_mask=config.learned_mask_embedding)
    lines = problems if got is None else diff(want, got)
    accepted = [b for b, messages in refused.items() if not messages]
    bidir_sliding = [i for i, (w, c) in enumerate(want["layers"]) if w is not None and not c]
    notes = ([f"layers {bidir_sliding}: bidirectional sliding; the right bound is per draft "
              "attention backend (not config-level; the exporter's rule sets model it)"]
             if bidir_sliding else [])
    if accepted:
        notes.append(f"exporter exports for SGLang with --sglang_attention_backend {accepted}")
    ok = not lines or not accepted
    if not lines:
        status = "as trained" + ("" if accepted else " at config level; exporter refuses")
    else:
        status = "refused by exporter" if ok else \
            f"FAIL: SGLang misreads it, yet the exporter accepts it for backends {accepted}"
    return {"target": arch, "status": status, "ok": ok, "sglang_differs": lines,
            "exporter_refusals": refused.get("any", []), "notes": notes}


def exporter_refusals(config: DrafterConfig, arch: str, name: str = "") -> dict[str, list[str]]:
    """The exporter's refusals for ``--engine sglang`` (SGLang 0.5.23) per draft attention
    backend choice (``any`` = every backend of the release), on row ``name``'s config.json."""
    out, raw = {}, written(name, config)
    for backend in SGLANG_BACKENDS:
        _, findings = plan_export(config, ("sglang",), sglang_version=SGLANG_VERSION,
                                  sglang_backend=backend, target_architecture=arch, raw=raw)
        out[backend] = [f.message for f in refusals(findings)]
    return out


def run_worker(items: dict[str, tuple[DrafterConfig, str]], python: Path) -> dict[str, Any]:
    """Write each export's config.json, run the worker in the SGLang venv, return its JSON."""
    if not python.is_file():
        raise SystemExit(f"{python} not found: run `make sglang-venv` first (docs/serving.md)")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name, (config, arch) in items.items():
            d = Path(tmp) / name
            d.mkdir()
            (d / "config.json").write_text(json.dumps(written(name, config)))
            jobs.append({"name": name, "dir": str(d), "target_architecture": arch})
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([str(python), str(WORKER), str(Path(tmp) / "jobs.json")],
                              capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"SGLang worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_all(items: dict[str, tuple[DrafterConfig, str]], worker: dict[str, Any],
              refusals_of=exporter_refusals) -> dict[str, dict[str, Any]]:
    """Verdict per export from the worker's JSON (``refusals_of(config, arch, name)``: the
    exporter's decision; a parameter so the unit test can pin it)."""
    if worker.get("sglang_version") != SGLANG_VERSION:
        raise SystemExit(f"the SGLang venv has sglang {worker.get('sglang_version')}, this check "
                         f"reads {SGLANG_VERSION}: rerun `make sglang-venv`")
    out = {}
    for name, (config, arch) in items.items():
        result = worker["exports"].get(name)
        if result is None:
            raise SystemExit(f"the SGLang worker returned nothing for {name}")
        out[name] = verdict(config, arch, result, refusals_of(config, arch, name),
                            written(name, config)["architectures"][0])
    return out


def report(verdicts: dict[str, dict[str, Any]]) -> str:
    """One block per export: status, then SGLang's differences, the exporter's refusals (first
    line of each) and notes."""
    lines = []
    for name, v in verdicts.items():
        lines.append(f"{'PASS' if v['ok'] else 'FAIL'}  {name} (target {v['target']}): "
                     f"{v['status']}")
        lines += [f"      SGLang differs: {d}" for d in v["sglang_differs"]]
        lines += [f"      exporter refuses: {r.splitlines()[0][:160]}"
                  for r in v["exporter_refusals"][:3]]
        if len(v["exporter_refusals"]) > 3:
            lines.append(f"      ... {len(v['exporter_refusals']) - 3} more refusals")
        lines += [f"      note: {n}" for n in v["notes"]]
    failed = [n for n, v in verdicts.items() if not v["ok"]]
    lines.append(f"{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return "\n".join(lines)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", type=Path, default=SGLANG_PYTHON)
    ap.add_argument("--out", type=Path, default=OUT / "summary.json")
    args = ap.parse_args(argv)
    items = exports()
    worker = run_worker(items, args.sglang_python)
    verdicts = check_all(items, worker)
    print(report(verdicts))
    refused = refused_rows()
    for name, why in refused.items():
        print(f"{'PASS' if why else 'FAIL'}  {name}: the exporter refuses SGLang: "
              f"{why[0][:160] if why else 'NOT REFUSED'}")
    _write_json(args.out, {"sglang_version": worker["sglang_version"], "exports": verdicts,
                           "sglang_raw": worker["exports"]})
    return 0 if all(v["ok"] for v in verdicts.values()) and all(refused.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
