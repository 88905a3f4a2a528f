"""Library API: export a drafter, inspect a serving directory (reading lives in formats/base.py).

Nothing is written unless every check passes: the directory is built in a temporary sibling,
self-checked, then renamed into place, so a refusal or a crash never leaves a partial OUT_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_lab.export import formats
from dflash_lab.export.checks import (
    REFUSE,
    Finding,
    apply_allow_lossy,
    check_engine,
    check_layout,
    check_target,
    mismatches,
    refusals,
    target_vocab_size,
)
from dflash_lab.export.engines import (
    ENGINES,
    RULE_SETS,
    Artifacts,
    EngineReading,
    rule_sets_for,
    select_sglang,
)
from dflash_lab.export.engines.common import architecture_of, layouts_agree
from dflash_lab.export.engines.sglang import DEFAULT_RELEASE
from dflash_lab.export.engines.zlab import DEFAULT_BLOCK_SIZE
from dflash_lab.export.formats import OURS, format_of, load_source, read_all
from dflash_lab.export.formats.base import (
    DEFAULT_ASSUMED_RULES,
    OUR_SPEC,
    artifacts_of,
    read_config_json,
    resolve_third_party,
    with_target_vocab,
)
from dflash_lab.export.outdir import (
    ENGINES_KEY,
    REPORT_FILE,
    SOURCE_PATH_KEY,
    check_output_dir,
    publish_modes,
    recorded_engines,
    refuse_overlap,
    stale_temp_dirs,
)
from dflash_lab.export.report import (
    as_trained_lines,
    drafter_lines,
    engine_notes,
    export_report,
    layer_table,
)
from dflash_lab.export.selfcheck import SelfCheckResult, run_self_check
from dflash_lab.export.weights import (
    CHECKSUMS_FILE,
    CODEBOOKS,
    CONFIG_FILE,
    DTYPES,
    MASK_FILE,
    SUFFIXED_CODEBOOKS,
    WEIGHTS_FILE,
    Source,
    Verification,
    cast,
    draft_vocab_problems,
    expected_shapes,
    has_weights,
    save_weights,
    split_mask_embedding,
    validate_state_dict,
    verify_dir,
    weight_shapes,
    write_checksums,
)
from dflash_lab.model.config import (
    DrafterConfig,
    LayerSpec,
)
from dflash_lab.paths import publish_dir, remove_path, temp_dir_beside
from dflash_lab.writer_lock import writer_lock


class ExportRefused(Exception):
    """The engine rules say at least one targeted engine would not run the trained drafter."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        lines = [f.message for f in refusals(findings)]
        super().__init__("export refused:\n  - " + "\n  - ".join(lines))


class SelfCheckFailed(Exception):
    """Reloading the export the way an engine does gave different draft logits."""


@dataclass
class ExportResult:
    out_dir: Path
    findings: list[Finding]
    self_check: list[SelfCheckResult] = field(default_factory=list)


#: ``--format``: our serving layout (default) and every other writable format (export/formats/)
FORMATS = formats.options()


def parse_engines(engine: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``both`` | ``vllm`` | ``sglang`` (or a list of engine names)."""
    if isinstance(engine, str):
        return ENGINES if engine == "both" else (engine,)
    return tuple(engine)


def serving_config(config: DrafterConfig, dtype: str) -> dict[str, Any]:
    """config.json: DrafterConfig.to_dict() plus the HF dtype bookkeeping key."""
    return formats.get(OURS).write_config(config, dtype, None, vocab_known=True)


def plan_export(config: DrafterConfig, engines: tuple[str, ...], *, target: dict | None = None,
                allow_lossy: bool = False, sglang_version: str = DEFAULT_RELEASE,
                sglang_backend: str = "any", target_architecture: str | None = None,
                raw: dict[str, Any] | None = None,
                ) -> tuple[dict[str, EngineReading], list[Finding]]:
    """Readings of every rule set (for the report) and the findings for the targeted engines
    (SGLang: the release and draft attention backend of :func:`select_sglang`). The target's
    class is ``target_architecture``, else ``architectures[0]`` of ``target``. ``raw``: the
    config.json to be written (default: ours, ``config.to_dict()``)."""
    if raw is None:  # before any engine rule: what our format's writer cannot carry is refused
        raw = formats.write_config(OURS, config, "bfloat16", None, vocab_known=True)
    artifacts = Artifacts(config.learned_mask_embedding, config.attention_sink_bias,
                          target_architecture=target_architecture or architecture_of(target))
    readings = read_all(raw, artifacts)
    table = select_sglang(sglang_version, sglang_backend)
    findings = check_layout(config)
    served = ", ".join(config.head.engines)
    for engine in engines:
        if engine in config.head.engines:
            findings += check_engine(config, readings, engine, table)
        else:  # the head's serving form is not for this engine (``Head.engines``)
            findings.append(Finding(REFUSE, f"{engine} does not serve a {config.head.title} "
                                    f"drafter (served by {served}); export with --engine "
                                    f"{served} (export.engine={served})", engine, lossy=False))
    findings += check_target(config, target)
    return readings, apply_allow_lossy(findings, allow_lossy)


def _commit(tmp: Path, out_dir: Path, force: bool) -> None:
    """Move the finished temp dir into place (:func:`~dflash_lab.paths.publish_dir`): an old
    OUT_DIR, which only ``force`` replaces, is swapped out, then deleted."""
    def forced(existing: Path) -> bool:
        if not force:
            raise FileExistsError(f"{existing} exists; pass --force to replace it")
        return True

    publish_dir(tmp, out_dir, replace_existing=forced)


#: The recorded target identity fields an export carries (local paths stay out of it).
EXPORTED_IDENTITY = ("architecture", "config_hash", "tokenizer_hash", "weights_fingerprint",
                     "chat_template_hash", "num_hidden_layers", "hidden_size", "vocab_size")


def format_config(fmt: str, config: DrafterConfig, dtype: str,
                  target_identity: dict[str, Any] | None, vocab_known: bool) -> dict[str, Any]:
    """The config.json of format ``fmt`` by its writer for the drafter (``writer_for``: DSpark
    and DFlash 2 Muse Glimmer have their own; ValueError naming what it cannot carry and the
    fix), recording :data:`EXPORTED_IDENTITY` of the training target (``TARGET_IDENTITY_KEY``)."""
    identity = {k: target_identity[k] for k in EXPORTED_IDENTITY
                if target_identity.get(k) is not None} if target_identity else None
    return formats.write_config(fmt, config, dtype, identity or None, vocab_known)


def export_drafter(source: str | Path | Source, out_dir: str | Path, *,
                   engine: str | list[str] = "both", dtype: str = "bfloat16",
                   force: bool = False, allow_lossy: bool = False,
                   target: dict[str, Any] | None = None, self_check: bool = True,
                   command: str | None = None, owner: str | Path | None = None,
                   sglang_version: str = DEFAULT_RELEASE,
                   sglang_backend: str = "any", verify: bool = True,
                   format: str = OURS) -> ExportResult:
    """Export ``source`` (checkpoint, run dir, serving dir or a loaded Source) to ``out_dir``,
    left as it was on any error: ValueError (bad input, or ``out_dir`` is or contains what the
    export reads), FileExistsError (no ``force``, or not a previous export; with ``owner`` only
    one of a source inside that run), ExportRefused or SelfCheckFailed. Settings: export/
    options.py; ``target``: the target's config.json (its class, sizes), ``verify``: the source's
    ``SHA256SUMS`` check (docs/export.md, "What is written", "Writing the Muse Glimmer
    layout")."""
    out_dir, engines = Path(out_dir), parse_engines(engine)
    if dtype not in DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {list(DTYPES)}")
    if format not in formats.options():
        raise ValueError(f"format '{format}' is not one of {list(formats.options())}")
    named = [] if isinstance(source, Source) else [source]
    refuse_overlap(out_dir, named)
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
    src = source if isinstance(source, Source) else load_source(source, verify)
    check_output_dir(out_dir, named + src.reads, force=force, owner=owner)  # + its checkpoint
    src = dataclasses.replace(src, config=with_target_vocab(  # Muse Glimmer: the --target's
        src.config, target_vocab_size(target), src.vocab_recorded))
    config = src.config
    state, mask = split_mask_embedding(src.state_dict, config, src.description)
    validate_state_dict(state, config, src.description)
    named_config = dataclasses.replace(config, _source=src.description)
    writer = formats.get(format).writer_for(named_config)
    raw = format_config(format, named_config, dtype, src.target_identity,
                        vocab_known=src.vocab_recorded or target_vocab_size(target) is not None)
    arch = architecture_of(target, src.target_identity)
    readings, findings = plan_export(config, engines, target=target, allow_lossy=allow_lossy,
                                     sglang_version=sglang_version, sglang_backend=sglang_backend,
                                     target_architecture=arch, raw=raw)
    if refusals(findings):
        raise ExportRefused(findings)
    header = {  # the resolved source path is read back to recognise a run's own export
        **writer.report_header(raw),
        "source": src.description,
        **({SOURCE_PATH_KEY: str(Path(named[0]).resolve())} if named else {}),
        "output": str(out_dir), ENGINES_KEY: ", ".join(engines),
        "dtype": dtype, "allow lossy": str(allow_lossy), "command": command or "(library call)",
        "versions": f"torch {torch.__version__}, python {platform.python_version()}",
        **({"source notes": "; ".join(src.notes)} if src.notes else {}),
    }
    with writer_lock(out_dir, what="OUT_DIR", beside=True, command=command):
        for stale in stale_temp_dirs(out_dir):  # left by a killed export (its pid is gone)
            remove_path(stale)
        with temp_dir_beside(out_dir) as tmp:  # deleted unless _commit moved it into place
            (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
            save_weights(tmp, cast(writer.serving_names(state), DTYPES[dtype]),  # format's names
                         None if mask is None else mask.detach().to(DTYPES[dtype]).contiguous(),
                         config.mask_token_id)
            checks, check_lines = _self_check(tmp, raw, src, engines, dtype, self_check,
                                              select_sglang(sglang_version, sglang_backend),
                                              arch)
            files = [CONFIG_FILE, WEIGHTS_FILE] + ([MASK_FILE] if mask is not None else [])
            report = export_report(
                header=header, config=config, readings=readings, findings=findings,
                self_check=check_lines, files=files + [REPORT_FILE, CHECKSUMS_FILE])
            (tmp / REPORT_FILE).write_text(report)
            write_checksums(tmp)  # last: over every file above
            publish_modes(tmp)
            _commit(tmp, out_dir, force)
    return ExportResult(out_dir, findings, checks)


def _self_check(tmp: Path, raw: dict[str, Any], src: Source, engines: tuple[str, ...],
                dtype: str, enabled: bool, table: tuple = RULE_SETS,
                arch: str | None = None) -> tuple[list[SelfCheckResult], list[str]]:
    if not enabled:
        return [], ["- SKIPPED (--no-self_check): the export was not reloaded and compared"]
    current = [r for r in rule_sets_for(engines, table) if r.current]
    artifacts = Artifacts(src.config.learned_mask_embedding, src.config.attention_sink_bias,
                          target_architecture=arch)
    results, how = run_self_check(tmp, raw, src.config, src.state_dict, current, artifacts,
                                  DTYPES[dtype])
    lines = [f"- {how}"] + [r.line() for r in results]
    failed = [r for r in results if not r.ok]
    if failed:
        raise SelfCheckFailed("self-check failed (export not written):\n" + "\n".join(
            r.line() for r in failed))
    return results, lines


# ---------------------------------------------------------------------------- inspect
OK, UNCHECKED, PROBLEMS = "ok", "unchecked", "problems"


@dataclass
class InspectResult:
    """How every rule set reads one serving directory, and whether they all agree."""

    path: Path
    trained: list[LayerSpec] | None  #: from our recorded training spec, None if third-party
    readings: dict[str, EngineReading]
    problems: list[str]
    text: str
    #: the layout every rule set is compared with: ``trained``, or for a third-party directory
    #: the importer's resolution (``assumed_rules``); None when neither can be read
    declared: list[LayerSpec] | None = None
    assumed_rules: str | None = None  #: OUR_SPEC, or the rule set resolving a third-party layout
    #: weight-dependent checks not made because the directory has no model.safetensors
    unchecked: list[str] = field(default_factory=list)
    #: findings of the engines not judged (not made for, or not chosen by ``--engine``)
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``problems`` (something disagrees or is wrong), ``unchecked`` (config.json is fine
        but the weight checks were not made) or ``ok`` (everything checked, nothing wrong)."""
        if self.problems:
            return PROBLEMS
        return UNCHECKED if self.unchecked else OK

    @property
    def ok(self) -> bool:
        """Everything was checked and nothing is wrong (never True without the weights)."""
        return self.status == OK


def _reading_problems(readings: dict[str, EngineReading], trained: list[LayerSpec] | None,
                      block: int) -> list[str]:
    """The rule sets' disagreements, dropped features and (ours) layers not run as trained."""
    loading = {k: r for k, r in readings.items() if r.loads}
    if not loading:
        return ["no rule set loads this directory"]
    ref_name, ref = next(iter(loading.items()))
    out = []
    for name, reading in loading.items():
        if name != ref_name and not layouts_agree(ref.layers, reading.layers, block):
            diff = [i for i, (a, b) in enumerate(zip(ref.layers, reading.layers, strict=True))
                    if not layouts_agree([a], [b], block)]
            out += [f"layer {i}: {ref_name} runs '{ref.layers[i].label()}' but {name} runs "
                    f"'{reading.layers[i].label()}'" for i in diff]
    out += [f"{r.rule_set} silently drops {item}" for r in loading.values() for item in r.dropped]
    for reading in readings.values() if trained is not None else ():
        out += [f.message for f in mismatches(trained, reading, block, "warn")]
    return out


def tensor_problems(config: DrafterConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Missing, unexpected or misshapen tensors for the config (DFlash 2: conv + selector).
    z-lab's ``...codebook.weight`` names count as the codebooks (engine rules report them)."""
    want = expected_shapes(config)
    have = {SUFFIXED_CODEBOOKS.get(k, k): v for k, v in shapes.items()}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    out = []
    if missing:
        head = config.head
        what = f" (a {head.title} drafter needs its {head.tensors})" \
            if set(missing) & set(head.weight_shapes(config)) else ""
        out.append(f"{WEIGHTS_FILE} lacks {len(missing)} tensor(s){what}: {missing[:6]}"
                   + ("..." if len(missing) > 6 else ""))
    if unexpected:
        out.append(f"{WEIGHTS_FILE} has tensors the config does not declare: {unexpected[:6]}")
    out += [f"{WEIGHTS_FILE}: {k} has shape {have[k]}, the config needs {want[k]}"
            for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    return out


@dataclass
class _Declared:
    """What config.json declares, read the way the importer reads it."""

    config: DrafterConfig | None  #: every field; None when config.json cannot be read
    layers: list[LayerSpec] | None  #: the trained spec, or the assumed rule set's layout
    assumed: str  #: OUR_SPEC or the rule set that resolved the layout
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _declared(d: dict[str, Any], path: Path, artifacts: Artifacts) -> _Declared:
    """A format read exactly (ours: the strict reader, the recorded training spec): that reading;
    third-party: the format's reading of the fields, the layout resolved as ``import_drafter``'s."""
    source, fmt = path / CONFIG_FILE, format_of(d)
    exact = fmt.exact_reading(d)
    assumed = exact or DEFAULT_ASSUMED_RULES
    try:
        config, notes = fmt.read_exact(d, source) if exact else (fmt.base_config(d, str(source)),
                                                                 [])
    except ValueError as err:
        return _Declared(None, None, assumed, [f"config.json cannot be read as a drafter: {err}"])
    if exact:
        return _Declared(config, config.layer_specs(), assumed, notes=notes)
    try:
        resolved, _ = resolve_third_party(d, path, artifacts, assumed, fmt)
    except ValueError as err:
        return _Declared(config, None, assumed, notes=[f"dflash-lab's importer cannot read it: "
                                                       f"{err}"])
    return _Declared(config, resolved.layer_specs(), assumed)


def unchecked_without_weights(config: DrafterConfig | None, path: Path) -> list[str]:
    """The checks ``--inspect`` makes from model.safetensors (and mask_embedding.pt), worded
    for a directory that lacks them: each could still make an engine run another drafter."""
    out = [f"tensor names and shapes against config.json (hidden_size, heads, vocab_size, the fc "
           f"input of every target layer): no {WEIGHTS_FILE}"]
    declared = config is not None and config.attention_sink_bias
    out.append("attention sinks: " + (
        "config.json declares them; whether the per-head sink tensors exist" if declared else
        "whether the weights hold layers.*.self_attn.attention_sink_bias tensors config.json "
        "does not declare (vLLM builds no sink parameter for them and drops them)"))
    if not (path / MASK_FILE).is_file():
        out.append(f"learned mask embedding: no {MASK_FILE} here, so whether the drafter ships "
                   "one (vLLM uses it for every MASK slot, SGLang >= 0.5.23 merges it into "
                   "the target's embedding row)")
    if config is None or set(CODEBOOKS) & set(expected_shapes(config)):
        out.append("DFlash 2 tensors: the conv and selector tensors, and whether the codebooks "
                   "carry z-lab save_pretrained's '.weight' names (vLLM refuses them, SGLang "
                   "skips them)")
    return out


def _verdict(problems: list[str], unchecked: list[str], judged: tuple[str, ...]) -> str:
    if problems:
        return f"NOT OK: {len(problems)} problem(s)" + (
            f"; {len(unchecked)} weight check(s) not made (no {WEIGHTS_FILE})" if unchecked else "")
    if unchecked:
        return (f"NOT FULLY CHECKED: from config.json alone every rule set runs the same layout, "
                f"but {len(unchecked)} weight check(s) were not made (see 'Not checked'); "
                f"inspect the directory with {WEIGHTS_FILE} for a full verdict")
    scope = "every rule set" if set(judged) >= set(ENGINES) else (
        f"every rule set of {', '.join(judged)} (the engines judged; the others: Notes)")
    return f"OK: {scope} runs the same drafter"


def _layout_lines(declared: _Declared, readings: dict[str, EngineReading], block: int,
                  config_only: bool) -> list[str]:
    """The drafter and, per rule set, whether it runs the declared layout."""
    if declared.config is None:
        return []
    lines = ["", "Drafter:"] + drafter_lines(declared.config) + [""]
    how = "trained" if declared.assumed == OUR_SPEC else (
        f"dflash-lab's importer reads it ({declared.assumed}: config.json leaves the layout to "
        "the engine)")
    scope = " (from config.json alone: the weights were not checked)" if config_only else ""
    lines.append(f"Runs the drafter as {how}?{scope}")
    if declared.layers is None:
        return lines + [f"- {note}" for note in declared.notes]
    return lines + as_trained_lines(declared.layers, readings, block)


def _judged_engines(path: Path, engine: str | list[str] | None) -> tuple[tuple[str, ...], str]:
    """(engines ``--inspect`` judges, why): ``engine``, else the export's (its report), else all."""
    if engine is not None:
        return parse_engines(engine), "chosen with --engine"
    recorded = recorded_engines(path)
    if recorded:
        return recorded, (f"the export was made for them ({REPORT_FILE}: {ENGINES_KEY}); "
                          "--engine to choose")
    return ENGINES, f"no {REPORT_FILE} record of the engines it was made for; --engine to choose"


def inspect_dir(path: str | Path, engine: str | list[str] | None = None,
                verify: bool = True) -> InspectResult:
    """``--inspect``: how each rule set runs a serving directory, judged for ``engine`` (default:
    those the export was made for, else both; the others' findings are notes); without
    model.safetensors the weight checks not made are ``unchecked``; ``verify``: its
    ``SHA256SUMS`` first (docs/export.md, "What is written", "Self-check")."""
    path = Path(path)
    config_only = not has_weights(path)
    integrity = (verify_dir(path, absent_ok=(WEIGHTS_FILE,) if config_only else ()) if verify
                 else Verification("skipped", []))
    d = read_config_json(path)
    # without model.safetensors only the mask file can be seen
    artifacts = Artifacts(mask_embedding_file=(path / MASK_FILE).is_file()) if config_only \
        else artifacts_of(path)
    judged, why = _judged_engines(path, engine)
    readings = read_all(d, artifacts, ENGINES)
    declared = _declared(d, path, artifacts)
    block = declared.config.block_size if declared.config else DEFAULT_BLOCK_SIZE
    trained = declared.layers if declared.assumed == OUR_SPEC else None
    engines = {r.name: r.engine for r in RULE_SETS}
    problems = integrity.problems + declared.problems + _reading_problems(
        {k: r for k, r in readings.items() if engines[k] in judged}, trained, block)
    notes = [p for p in _reading_problems(readings, trained, block) if p not in problems]
    vocab_lines: list[str] = []
    if declared.config is not None and not config_only:
        shapes = weight_shapes(path)
        problems += tensor_problems(declared.config, format_of(d).our_names(shapes, d))
        vocab_lines, vocab_problems = draft_vocab_problems(path, declared.config)
        problems += vocab_problems
    unchecked = unchecked_without_weights(declared.config, path) if config_only else []
    lines = [f"# {path}", "", f"files: {integrity.note}", "",
             f"judged for: {', '.join(judged)} ({why})", "",
             f"block_size={block}; rule sets: "
             + ", ".join(f"{r.name} ({'current' if r.current else 'older'})"
                         for r in RULE_SETS if r.name in readings), ""]
    lines += layer_table(trained, readings, block)
    lines += _layout_lines(declared, readings, block, config_only)
    lines += ["", *vocab_lines] if vocab_lines else []
    lines += format_of(d).inspect_lines(d) if declared.config is not None else []
    lines += ["", "Engine refusals and silently dropped features:"] + engine_notes(readings)
    if notes:
        lines += ["", "Notes (engines it is not judged for, not problems):"]
        lines += [f"- {n}" for n in notes]
    lines += ["", "Problems:"] + ([f"- {p}" for p in problems] or ["- none"])
    if unchecked:
        lines += ["", f"Not checked (no {WEIGHTS_FILE}: config.json alone):"]
        lines += [f"- {u}" for u in unchecked]
    text = "\n".join(lines + ["", _verdict(problems, unchecked, judged)])
    return InspectResult(path, trained, readings, problems, text, declared.layers,
                         declared.assumed, unchecked, notes)
