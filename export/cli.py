"""``dflash-export``: checkpoint / run dir / serving dir -> vLLM + SGLang serving directory;
the options, ``--recipe`` and the exit codes (nothing written unless 0): docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from dflash_lab.errors import debugging, output_error
from dflash_lab.export.api import (
    OK,
    UNCHECKED,
    ExportRefused,
    SelfCheckFailed,
    export_drafter,
    inspect_dir,
)
from dflash_lab.export.checks import WARN
from dflash_lab.export.formats import load_source
from dflash_lab.export.options import (
    add_export_options,
    export_kwargs,
    recipe_export_section,
    resolve_options,
)
from dflash_lab.export.weights import CONFIG_FILE, Source

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_SELF_CHECK, EXIT_UNCHECKED = 0, 2, 3, 4, 5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-export",
        description="Export a DFlash drafter for vLLM and SGLang, refusing layouts an engine "
                    "would run differently from training; or --inspect a serving directory.")
    p.add_argument("source", nargs="?", help="Lightning .ckpt, training run dir, or serving dir")
    p.add_argument("out_dir", nargs="?", help="serving directory to create")
    p.add_argument("--inspect", metavar="DIR",
                   help="print how each engine reads DIR and exit, judged for the engines "
                        "the export was made for (its EXPORT_REPORT.md; --engine to choose); "
                        "config.json alone is enough for the layout; exit 5 when the weight "
                        "checks could not be made")
    p.add_argument("--recipe", metavar="NAME",
                   help="take the export settings from recipe NAME's export section (as "
                        "dflash-train recipe=NAME composes it; also spelled recipe=NAME); "
                        "options given here override it")
    add_export_options(p)
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT_DIR if it is empty or a previous export "
                        "(never a directory holding other files, SOURCE or its checkpoint)")
    p.add_argument("--target", metavar="PATH",
                   help="target model dir, hub id (HF cache), config.json or .gguf file: check "
                        "hidden/vocab size and layer ids")
    p.add_argument("--allow-other-target-weights", action="store_true",
                   help="export although --target's weights fingerprint differs from the one "
                        "the training checkpoint recorded")
    p.add_argument("--no-verify", action="store_true",
                   help="read a serving directory (SOURCE, or --inspect's) without checking it "
                        "against its SHA256SUMS: for a directory edited on purpose")
    return p


def _read_target(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    file = Path(path)
    if path.endswith(".gguf") or not file.exists():
        # A GGUF's config is its metadata; a hub id is read through the HF cache (offline with
        # HF_HUB_OFFLINE=1), as every other entry point reads it.
        from dflash_lab.targets.loader import load_target_config

        return load_target_config(path).to_dict()
    file = file / CONFIG_FILE if file.is_dir() else file
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--target {path}: cannot read {file} ({err})") from err


def _check_target_weights(src: Source, target: str | None, allow: bool) -> None:
    """``--target`` must be the checkpoint the drafter was trained on: its weights fingerprint
    equals the one the training checkpoint recorded (same config and tokenizer are not enough:
    a drafter trained on other weights drafts for those). Older checkpoints carry none."""
    recorded = (src.target_identity or {}).get("weights_fingerprint")
    if target is None or recorded is None:
        return
    from dflash_lab.targets.loader import split_gguf_path
    from dflash_lab.targets.target import target_weight_files, weights_fingerprint

    name, gguf = split_gguf_path(target, None)
    files = target_weight_files(name, gguf)
    have = weights_fingerprint(files) if files else None
    if have is not None and have != recorded and not allow:
        raise ValueError(f"--target {target}: its weights fingerprint {have[:16]}... differs from "
                         f"the one {src.description} was trained on ({recorded[:16]}...): another "
                         "checkpoint with the same config. Pass the training target, or "
                         "--allow-other-target-weights to export anyway")


def _export(args: argparse.Namespace, opts: dict[str, Any], argv: list[str]) -> int:
    if args.target is not None:
        _check_target_weights(load_source(args.source, not args.no_verify), args.target,
                              args.allow_other_target_weights)
    result = export_drafter(
        args.source, args.out_dir, force=args.force, target=_read_target(args.target),
        command=shlex.join(["dflash-export", *argv]), verify=not args.no_verify,
        **export_kwargs(opts, "dflash-export"))
    for finding in result.findings:
        if finding.severity == WARN:
            print(f"dflash-export: warning: {finding.message}", file=sys.stderr)
    print(f"wrote {result.out_dir} (see {result.out_dir / 'EXPORT_REPORT.md'})")
    return EXIT_OK


def recipe_stage_only(argv: list[str]) -> bool:
    """``recipe=NAME`` without SOURCE and OUT_DIR (or --inspect): the recipe's export stage, its
    run root's train folder -> export folder (docs/pipeline.md); with paths, only its settings."""
    positional = [a for a in argv if not a.startswith("-") and "=" not in a]
    return (any(a.startswith("recipe=") for a in argv) and not positional
            and not any(a.startswith("--inspect") for a in argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # recipe=NAME, as dflash-train and the other commands spell it, is --recipe NAME
    args = parser.parse_args([t for a in argv for t in (
        ["--recipe", a.removeprefix("recipe=")] if a.startswith("recipe=") else [a])])
    if args.inspect is None and (args.source is None or args.out_dir is None):
        parser.error("give SOURCE and OUT_DIR, or --inspect DIR")
    try:
        section = recipe_export_section(args.recipe) if args.recipe else None
        opts = resolve_options(args, section, f"recipe {args.recipe}")
        if args.inspect:  # judged for --engine, else for the engines the export recorded
            result = inspect_dir(args.inspect, args.engine, verify=not args.no_verify)
            print(result.text)
            return {OK: EXIT_OK, UNCHECKED: EXIT_UNCHECKED}.get(result.status, EXIT_REFUSED)
        return _export(args, opts, argv)
    except (ExportRefused, SelfCheckFailed) as err:
        print(f"dflash-export: {err}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(err, ExportRefused) else EXIT_SELF_CHECK
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"dflash-export: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # a full disk, an OUT_DIR that cannot be written
        output = output_error(err, "OUT_DIR as it was (an export appears whole or not at all)")
        if output is None or debugging():
            raise
        print(f"dflash-export: error: {output}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
