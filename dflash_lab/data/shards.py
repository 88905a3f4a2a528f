"""THE capture shard format: writer, manifest and reader in one module (docs/capture.md,
"Output format (format_version 1)", "The target distribution", "Disk estimate"). A shard stores
its samples concatenated along the token axis: ``input_ids`` [T], ``loss_mask`` [T],
``target_argmax`` [T], ``hidden`` [T, D], ``offsets`` [n + 1], ``sample_ids`` [n], and with
``capture.distribution`` ``target_last_hidden`` [T, H], ``target_top_ids`` /
``target_top_logprobs`` [T, k]. T tokens of the shard, n samples, D = nL*H, k top-k.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from dflash_lab.checksums import sha256_file, sha256_json
from dflash_lab.dtypes import DTYPES
from dflash_lab.paths import atomic_path, atomic_write_text
from dflash_lab.targets.features import hf_hidden_state_indices

FORMAT_NAME = "dflash-lab-capture"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
PLAN_FILE = "capture_plan.json"
#: The manifest's checksum of itself (:func:`sha256_json` of every other key): an edited or
#: damaged manifest is refused by name (:func:`check_sealed`).
SEAL_KEY = "manifest_sha256"
log = logging.getLogger(__name__)
HIDDEN_DTYPES = DTYPES  #: what a shard may store its hidden states as (every named dtype)


@dataclass
class CapturedSample:
    """One captured sequence: ``input_ids``, ``loss_mask``, ``target_argmax`` [S], hidden [S, D]."""

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    target_argmax: torch.Tensor
    target_last_hidden: torch.Tensor | None = None  #: [S, H] with distribution last_hidden
    target_top_ids: torch.Tensor | None = None  #: [S, k] with distribution topk
    target_top_logprobs: torch.Tensor | None = None  #: [S, k]


#: ``capture.distribution`` entries: what of the target's distribution a capture keeps.
DISTRIBUTION_KINDS = ("last_hidden", "topk")
#: The distribution tensors of a shard and their stored dtypes (None: the hidden dtype).
DISTRIBUTION_TENSORS = {"target_last_hidden": None, "target_top_ids": torch.int32,
                        "target_top_logprobs": torch.float32}


def distribution_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """What of the target distribution a capture holds: ``{"last_hidden": bool, "topk": k}``
    (captures from before the option hold neither: argmax labels only)."""
    found = manifest.get("distribution") or {}
    return {"last_hidden": bool(found.get("last_hidden", False)),
            "topk": int(found.get("topk", 0))}


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_record_file(index: int) -> str:
    return f"shard-{index:05d}.json"


def bytes_per_token(feature_dim: int, hidden_dtype: str, *, last_hidden_size: int = 0,
                    topk: int = 0) -> int:
    """Disk bytes per captured token: hidden + input id + argmax id + loss-mask byte, plus the
    last hidden state (``last_hidden_size`` = H when kept) and 4 + 4 bytes per top-k entry."""
    itemsize = HIDDEN_DTYPES[hidden_dtype].itemsize
    return (feature_dim + last_hidden_size) * itemsize + 4 + 4 + 1 + 8 * topk


def write_json_atomic(path: Path, obj: Any) -> None:
    """JSON via a temp file + rename: never half-written; ranks never collide (``temp_beside``)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------- writer
def write_shard(out_dir: str | Path, index: int, samples: list[CapturedSample],
                hidden_dtype: str = "bfloat16", feature_dim: int | None = None,
                report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write one shard (temporary name, then rename) and then its record ``shard-XXXXX.json``,
    which marks it finished; returns the record. ``feature_dim``: needed only for no ``samples``;
    ``report``: the capture's ``bad_rows``, ``zero_loss_rows``, min/max loss tokens, kept."""
    out_dir = Path(out_dir)
    dim = samples[0].hidden.shape[-1] if samples else feature_dim
    if dim is None:
        raise ValueError("write_shard: feature_dim is required for an empty shard")
    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)

    def cat(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        parts = [getattr(s, name).to("cpu", dtype) for s in samples]
        return torch.cat(parts).contiguous() if parts else torch.zeros(shape, dtype=dtype)

    tensors = {
        "input_ids": cat("input_ids", torch.int32, (0,)),
        "loss_mask": cat("loss_mask", torch.uint8, (0,)),
        "target_argmax": cat("target_argmax", torch.int32, (0,)),
        "hidden": cat("hidden", HIDDEN_DTYPES[hidden_dtype], (0, dim)),
        "offsets": offsets,
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
    }
    for name, dtype in DISTRIBUTION_TENSORS.items():
        if samples and getattr(samples[0], name) is not None:
            tensors[name] = cat(name, dtype or HIDDEN_DTYPES[hidden_dtype], ())
    path = out_dir / shard_file(index)
    with atomic_path(path) as tmp:
        # One metadata key only: safetensors writes metadata keys in random order, and shard
        # checksums must be reproducible (resume and rank-split tests compare them).
        save_file(tensors, str(tmp), metadata={"format": f"{FORMAT_NAME}/{FORMAT_VERSION}"})
        os.chmod(tmp, 0o644)  # shared capture dirs: readable by the training job's user
    record = {
        "index": index, "file": path.name, "num_samples": len(samples),
        "num_tokens": int(offsets[-1]), "num_loss_tokens": int(tensors["loss_mask"].sum()),
        "bytes": path.stat().st_size, "sha256": sha256_file(path), **(report or {}),
    }
    write_json_atomic(out_dir / shard_record_file(index), record)
    return record


def finished_shard(out_dir: str | Path, index: int, verify: bool = True) -> dict | None:
    """The record of a finished, intact shard, or None if it must be (re)written."""
    out_dir = Path(out_dir)
    rec_path, path = out_dir / shard_record_file(index), out_dir / shard_file(index)
    if not rec_path.is_file() or not path.is_file():
        return None
    try:
        record = json.loads(rec_path.read_text())
    except json.JSONDecodeError:
        return None
    if path.stat().st_size != record.get("bytes") or (
            verify and sha256_file(path) != record.get("sha256")):
        return None
    return record


# ---------------------------------------------------------------------------------- manifest
def merge_manifest(out_dir: str | Path, verify: bool = False) -> dict | None:
    """``manifest.json`` from the plan and all shard records; None while a shard is unfinished."""
    out_dir = Path(out_dir)
    plan = json.loads((out_dir / PLAN_FILE).read_text())
    records = [finished_shard(out_dir, i, verify) for i in range(plan["num_shards"])]
    if any(r is None for r in records):
        return None
    num_samples = sum(r["num_samples"] for r in records)
    num_loss = sum(r["num_loss_tokens"] for r in records)
    bad = [b for r in records for b in r.get("bad_rows", [])]
    zero = [z for r in records for z in r.get("zero_loss_rows", [])]
    kept = [r for r in records if r["num_samples"]]
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, **plan,
        "num_samples": num_samples,
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_loss_tokens": num_loss,
        # Loss tokens per sample (every kept sample has at least one).
        "loss_tokens_per_sample": {
            "min": min((r.get("min_loss_tokens", 0) for r in kept), default=0),
            "mean": num_loss / num_samples if num_samples else 0.0,
            "max": max((r.get("max_loss_tokens", 0) for r in kept), default=0),
        },
        # Input rows not captured: bad rows (skipped with capture.bad_rows=skip, with reasons),
        # rows with no loss token after truncation; num_dropped counts both.
        "num_bad_rows": len(bad), "bad_rows": bad,
        "num_zero_loss_rows": len(zero), "zero_loss_rows": zero,
        "num_dropped": plan["num_input_rows"] - num_samples,
        "shards": records,
    }
    manifest[SEAL_KEY] = sha256_json(json.loads(json.dumps(manifest)))  # as read back
    write_json_atomic(out_dir / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(capture_dir: str | Path) -> dict[str, Any]:
    """Load and check the format/version of ``manifest.json`` (ValueError naming the file)."""
    path = Path(capture_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no manifest; the capture is missing or unfinished (rerun "
                         "dflash-capture with the same settings to finish and merge it)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); rerun dflash-capture") from err
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format={manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version={manifest.get('format_version')!r}, this "
                         f"dflash-lab reads {FORMAT_VERSION}; recapture or use a matching version")
    check_sealed(manifest, path)
    return manifest


def check_sealed(manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest whose two layer conventions disagree (``hf_hidden_state_indices`` =
    ``target_layer_ids`` + 1) or whose fields no longer match its :data:`SEAL_KEY`. A manifest
    from before the seal only warns: it is read as before (docs/capture.md)."""
    redo = (f"rerun dflash-capture with the same settings and capture.out_dir={path.parent} "
            f"(it rebuilds {MANIFEST_FILE} from {PLAN_FILE} and the shard records), or recapture")
    ids, hf = manifest.get("target_layer_ids"), manifest.get("hf_hidden_state_indices")
    if ids is not None and hf is not None and hf_hidden_state_indices(ids) != list(hf):
        raise ValueError(f"{path}: target_layer_ids={ids} and hf_hidden_state_indices={hf} "
                         "disagree (each HF index is its layer id + 1): the manifest was "
                         f"edited; {redo}")
    recorded = manifest.get(SEAL_KEY)
    if recorded is None:
        log.warning(
            "%s: no %s (a capture from before manifests were sealed): edits to it cannot be "
            "detected; %s to seal it", path, SEAL_KEY, redo.split(", or")[0])
    elif recorded != sha256_json(manifest, without=SEAL_KEY):
        raise ValueError(f"{path}: its fields no longer match its {SEAL_KEY} {recorded[:16]}... "
                         f"(the manifest was edited or damaged after the capture); {redo}")


def check_manifest(manifest: dict[str, Any], source: str = "manifest", *,
                   target_layer_ids: list[int] | None = None, hidden_size: int | None = None,
                   vocab_size: int | None = None, target_hidden_size: int | None = None,
                   target: dict[str, Any] | None = None,
                   allow_other_weights: bool = False) -> None:
    """Refuse a capture that does not match what the caller expects; ``target``: a target
    identity (``Target.identity()``) whose config, tokenizer and weights (:func:`check_weights`)
    must match. Each ValueError names both values and the fix."""
    expected = {"target_layer_ids": target_layer_ids, "hidden_size": hidden_size,
                "vocab_size": vocab_size, "target_hidden_size": target_hidden_size}
    actual = {"target_layer_ids": manifest["target_layer_ids"],
              "hidden_size": manifest["hidden_size"],
              "vocab_size": manifest["target"]["vocab_size"],
              # recorded only when not hidden_size (a multi-stream target's flattened streams)
              "target_hidden_size": int(manifest.get("target_hidden_size",
                                                     manifest["hidden_size"]))}
    for key in ("config_hash", "tokenizer_hash") if target is not None else ():
        expected[f"target.{key}"] = target[key]
        actual[f"target.{key}"] = manifest["target"][key]
    for key, want in expected.items():
        if want is not None and list_or_value(want) != list_or_value(actual[key]):
            raise ValueError(
                f"{source}: capture has {key}={actual[key]!r} but {want!r} was expected; "
                "recapture with the matching target / target_layer_ids, or configure the "
                "drafter to match the capture"
            )
    if target is not None:
        check_weights(manifest["target"], target, source, allow_other_weights)


def check_weights(recorded: dict[str, Any], target: dict[str, Any], source: str,
                  allow: bool = False, override: str = "data.allow_other_target_weights=true"
                  ) -> None:
    """Refuse features (or a run) made with another checkpoint of the same config: the
    recorded and the loaded ``weights_fingerprint`` must match (``override``: the setting that
    accepts it). A record from before fingerprints or a target without weight files only warns."""
    want, have = target.get("weights_fingerprint"), recorded.get("weights_fingerprint")
    if want is None or have is None:
        log.warning(
            "%s: no target weights fingerprint to compare (recorded %s, loaded %s): cannot "
            "check that the same checkpoint made it", source, have, want)
        return
    if want != have and not allow:
        raise ValueError(
            f"{source}: made with target weights {have[:16]}... but the loaded target "
            f"{target.get('name_or_path')!r} has weights {want[:16]}... (same config and "
            f"tokenizer, another checkpoint); use the target it was made with, or {override} "
            "to use it anyway")


def list_or_value(v: Any) -> Any:
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else v


# ---------------------------------------------------------------------------------- reader
#: ``verify_checksums`` values: hash every shard at start-up, each shard when first read in a
#: process (the default: a flipped byte is an error naming the shard, at the cost of reading
#: each shard once more per process), or check sizes and headers only.
VERIFY_MODES = (True, "first_use", False)


class ShardDataset(Dataset):
    """Memory-mapped samples of a capture directory, validated at construction. Item:
    ``input_ids`` [S] int64, ``loss_mask`` [S] bool, ``hidden`` [S, D] (stored dtype),
    ``target_argmax`` [S] int64, ``sample_id``. Keywords: :func:`check_manifest`'s; sizes and
    headers are always checked, each shard's sha256 per ``verify_checksums`` (VERIFY_MODES)."""

    def __init__(self, capture_dir: str | Path, *, verify_checksums: bool | str = "first_use",
                 **expect: Any):
        if verify_checksums not in VERIFY_MODES:
            raise ValueError(f"data.verify_checksums={verify_checksums!r}: use true (all shards "
                             "at start-up), first_use (each when first read) or false")
        self.root = Path(capture_dir)
        self.manifest = read_manifest(self.root)
        check_manifest(self.manifest, str(self.root / MANIFEST_FILE), **expect)
        self._files: list[Path] = []
        self._index: list[tuple[int, int, int, int]] = []  # (shard, local k, start, end)
        for shard_no, rec in enumerate(self.manifest["shards"]):
            path = self.root / rec["file"]
            self._check_shard(path, rec, verify_checksums is True)
            offsets = self._open(path).get_tensor("offsets").tolist()
            self._files.append(path)
            self._index.extend((shard_no, j, a, b)
                               for j, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])))
        self._hash_on_open = verify_checksums == "first_use"
        self._handles: dict[int, Any] = {}
        held = distribution_of(self.manifest)
        self._extra = [name for name, kind in (("target_last_hidden", "last_hidden"),
                                               ("target_top_ids", "topk"),
                                               ("target_top_logprobs", "topk")) if held[kind]]

    @staticmethod
    def _check_shard(path: Path, rec: dict, verify: bool) -> None:
        if not path.is_file():
            raise ValueError(f"{path}: shard listed in the manifest is missing; rerun "
                             "dflash-capture on this directory to rewrite it")
        if path.stat().st_size != rec["bytes"]:
            raise ValueError(f"{path}: truncated or corrupt ({path.stat().st_size} bytes, "
                             f"manifest says {rec['bytes']}); delete it and rerun dflash-capture")
        if verify and sha256_file(path) != rec["sha256"]:
            raise ValueError(f"{path}: checksum mismatch (corrupt shard: its sha256 is not the "
                             "manifest's); delete it and rerun dflash-capture")

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path}: unreadable shard ({err}); delete it and rerun "
                             "dflash-capture") from err

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, k: int) -> dict[str, Any]:
        shard_no, local = self._index[k][:2]
        item = {**self.tokens(k), **self._read(k, ("hidden", *self._extra))}
        ids = self._handles[shard_no].get_slice("sample_ids")
        return {**item, "sample_id": int(ids[local:local + 1][0])}

    def lengths(self) -> list[int]:
        """Tokens of every sample, from the shard offsets (no sample is read)."""
        return [end - start for _, _, start, end in self._index]

    def tokens(self, k: int) -> dict[str, Any]:
        """Item k's token columns only (``input_ids``, ``loss_mask``, ``target_argmax``): what
        counting the training tokens needs, without reading the hidden states."""
        item = self._read(k, ("input_ids", "loss_mask", "target_argmax"))
        return {"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].bool(),
                "target_argmax": item["target_argmax"].long()}

    def _read(self, k: int, names: tuple[str, ...]) -> dict[str, Any]:
        shard_no, _, a, b = self._index[k]
        if shard_no not in self._handles:
            if self._hash_on_open:
                self._check_shard(self._files[shard_no], self.manifest["shards"][shard_no], True)
            self._handles[shard_no] = self._open(self._files[shard_no])
        f = self._handles[shard_no]
        return {name: f.get_slice(name)[a:b] for name in names}

    def __getstate__(self) -> dict[str, Any]:
        # Open handles are per process (DataLoader workers reopen them lazily).
        return {**self.__dict__, "_handles": {}}
