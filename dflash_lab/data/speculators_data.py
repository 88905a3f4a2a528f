"""A speculators hidden-states dataset (``prepare-data`` rows + ``generate-offline-data``
``hs_{i}.safetensors`` files, speculators 0.9.0) read as an offline data source (``data.format``).
Their layer id k is the stream entering decoder layer k, ours + 1; our last id is their id L
through the target's final norm, from which ``target_last_hidden`` [S, H] and ``target_argmax``
[S] are derived per sample (docs/data.md, "speculators data"). Shapes: S sequence, n stored
layers, H hidden, L decoder layers, V vocabulary.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from dflash_lab.data.shards import MANIFEST_FILE
from dflash_lab.targets.features import chunked_argmax

log = logging.getLogger(__name__)

#: ``data.format`` values: detect by the files present, or say which.
FORMATS = ("auto", "dflash_lab", "speculators")
#: The files of a ``Dataset.save_to_disk`` directory (speculators prepare-data's output).
SPECULATORS_FILES = ("dataset_info.json", "state.json")
#: Where generate-offline-data puts the states by default, under the prepare-data directory.
HIDDEN_STATES_DIR = "hidden_states"
#: The tensor of per-token scales in their FP8 connector's files.
FP8_SCALES_KEY = "hidden_states_scales"
LAYER_IDS_FIELD = "data.speculators_layer_ids"


def hs_file(index: int) -> str:
    """The states file of prepare-data row ``index`` (generate-offline-data's name)."""
    return f"hs_{index}.safetensors"


def detect_format(path: str | Path, requested: str = "auto") -> str:
    """``dflash_lab`` (a ``manifest.json``) or ``speculators`` (a ``save_to_disk`` directory); an
    explicit ``requested`` needs its files, else a ValueError naming the directory and formats."""
    if requested not in FORMATS:
        raise ValueError(f"data.format={requested!r}: use one of {list(FORMATS)}")
    root = Path(path)
    found = {"dflash_lab": (root / MANIFEST_FILE).is_file(),
             "speculators": all((root / f).is_file() for f in SPECULATORS_FILES)}
    if requested != "auto" and found[requested]:
        return requested
    if requested == "auto" and found["dflash_lab"] != found["speculators"]:
        return "dflash_lab" if found["dflash_lab"] else "speculators"
    what = {"dflash_lab": f"{MANIFEST_FILE} (a finished dflash-capture out_dir)",
            "speculators": f"{' and '.join(SPECULATORS_FILES)} (a speculators prepare-data "
                           f"output, states in {HIDDEN_STATES_DIR}/hs_<row>.safetensors)"}
    if requested == "auto" and all(found.values()):
        raise ValueError(f"data.path={root}: holds both {what['dflash_lab']} and "
                         f"{what['speculators']}; set data.format=dflash_lab or speculators")
    if requested in ("auto", "dflash_lab") and (root / "capture_plan.json").is_file():
        return "dflash_lab"  # an unfinished capture: read_manifest says how to finish it
    expected = " or ".join(what[w] for w in ([requested] if requested != "auto" else what))
    state = "" if root.is_dir() else " (does not exist)"
    raise ValueError(f"data.path={root}{state} has no {expected} (data.format={requested}); "
                     "point data.path at one of those")


def layer_rows(their_ids: list[int], target_layer_ids: list[int],
               num_hidden_layers: int) -> tuple[list[int], int]:
    """Where each of our ``target_layer_ids`` lies among their stored states, and where their
    last-layer state (id L) lies: ``(rows, last_row)``. Our id L - 1 maps to ``-1``: derived
    from the last state with the final norm. ValueError naming the field for what is missing."""
    L = int(num_hidden_layers)
    ids = sorted(int(i) for i in their_ids)
    if len(set(ids)) != len(ids) or not ids or ids[0] < 0 or ids[-1] > L:
        raise ValueError(f"{LAYER_IDS_FIELD}={list(their_ids)}: need distinct ids in [0, {L}] "
                         "(as passed to speculators' launch_vllm.py --target-layer-ids, with the "
                         f"last layer {L} it appends)")
    if L not in ids:
        raise ValueError(f"{LAYER_IDS_FIELD}={list(their_ids)} has no last layer {L}: without "
                         "the final state the target's argmax cannot be derived; regenerate the "
                         "states with launch_vllm.py --include-last-layer (its default)")
    rows = []
    for ours in target_layer_ids:
        if int(ours) == L - 1:
            rows.append(-1)
        elif int(ours) + 1 in ids:
            rows.append(ids.index(int(ours) + 1))
        else:
            raise ValueError(
                f"drafter target_layer_ids={list(target_layer_ids)}: layer {ours} (their id "
                f"{int(ours) + 1}) is not in the speculators data ({LAYER_IDS_FIELD}={ids}); "
                "configure the drafter with layers the data holds (ours = theirs - 1; "
                f"{L - 1} is derived from {L}) or regenerate the states with those layers")
    return rows, ids.index(L)


class SpeculatorsDataset(Dataset):
    """A speculators prepare-data directory and its states as :class:`ShardDataset` items
    (``hidden`` [S, nL*H] in our ``target_layer_ids`` order, ``sample_id``: the prepare-data row)
    plus ``target_last_hidden`` [S, H]. ``target``: the states' target (its final norm and LM
    head, copied to the CPU: head-only loads do). Headers and token ids checked at construction."""

    def __init__(self, path: str | Path, *, target: Any, target_layer_ids: list[int],
                 layer_ids: list[int] | None = None, hidden_states_path: str | Path | None = None,
                 hidden_size: int | None = None, vocab_size: int | None = None,
                 target_hidden_size: int | None = None, **_: Any):
        from datasets import load_from_disk

        if target_layer_ids is None:
            raise ValueError(f"{path}: reading speculators data needs the drafter's "
                             "target_layer_ids (dflash-train passes them)")
        if target is None:
            raise ValueError(f"{path}: reading speculators data needs the target (its final norm "
                             "and LM head derive target_argmax); dflash-train passes it")
        self.root = Path(path)
        self.states_dir = Path(hidden_states_path) if hidden_states_path else (
            self.root / HIDDEN_STATES_DIR)
        L, H = target.num_hidden_layers, target.hidden_size
        # their states are vLLM's aux hidden states: H wide per layer (a multi-stream target's
        # stream mean), so a drafter reading flattened streams cannot train on them
        for name, want, have in (("hidden_size", hidden_size, H), ("vocab_size", vocab_size,
                                                                   target.vocab_size),
                                 ("target_hidden_size", target_hidden_size, H)):
            if want is not None and int(want) != int(have):
                raise ValueError(f"{self.root}: the drafter expects {name}={want} but the target "
                                 f"has {have}; use the target the speculators data was made with")
        # speculators' default extraction ids for a text target: [2, L // 2, L - 3] and L
        # (launch_vllm.py with --include-last-layer)
        self.their_ids = sorted(layer_ids) if layer_ids else [2, L // 2, L - 3, L]
        if not layer_ids:
            log.warning("%s: %s not set, assuming speculators' default extraction ids %s (the "
                        "files do not record them)", self.root, LAYER_IDS_FIELD, self.their_ids)
        self.rows, self.last_row = layer_rows(self.their_ids, list(target_layer_ids), L)
        self.table = load_from_disk(str(self.root)).with_format("torch",
                                                                columns=["input_ids", "loss_mask"])
        self.hidden_size, self.vocab_size = H, target.vocab_size
        pieces = target.pieces()
        self.norm = copy.deepcopy(pieces.norm).to("cpu").eval().requires_grad_(False)
        self.lm_head = copy.deepcopy(pieces.lm_head).to("cpu").eval().requires_grad_(False)
        self.index = self._present_rows()
        lengths = self.lengths()  # what dflash-train reads from a manifest
        self.manifest = {"format": "speculators", "path": str(self.root),
                         "speculators_layer_ids": self.their_ids, "num_samples": len(lengths),
                         "max_length": max(lengths),
                         "distribution": {"last_hidden": True, "topk": 0}}

    def _present_rows(self) -> list[int]:
        """Rows with a states file, each checked (header shape and token ids)."""
        if not self.states_dir.is_dir():
            raise ValueError(f"{self.states_dir}: no hidden-states directory; run speculators "
                             "generate-offline-data on this prepare-data output (or set "
                             "data.hidden_states_path to its --output)")
        present = [i for i in range(len(self.table)) if (self.states_dir / hs_file(i)).is_file()]
        missing = len(self.table) - len(present)
        if missing:
            log.warning("%s: %d of %d rows have no %s file and are left out (generate-offline-"
                        "data --max-samples, or skipped failures)", self.root, missing,
                        len(self.table), "hs_<row>.safetensors")
        if len(present) < 2:
            raise ValueError(f"{self.states_dir}: {len(present)} hs_<row>.safetensors files for "
                             f"{len(self.table)} rows of {self.root}; need at least 2 (run "
                             "speculators generate-offline-data)")
        for i in present:
            self._check_file(i)
        return present

    def _check_file(self, i: int) -> None:
        path = self.states_dir / hs_file(i)
        try:
            with safe_open(str(path), framework="pt") as f:
                shape = f.get_slice("hidden_states").get_shape()
                tokens = f.get_tensor("token_ids")
        except Exception as err:  # safetensors raises its own types; a missing key too
            raise ValueError(f"{path}: unreadable speculators states file ({err}); delete it and "
                             "rerun generate-offline-data (it regenerates missing files)") from err
        want = [int(self.table[i]["input_ids"].shape[0]), len(self.their_ids), self.hidden_size]
        if list(shape) != want:
            field = ("the target's hidden size" if shape[-1:] != want[-1:] else LAYER_IDS_FIELD
                     if len(shape) == 3 and shape[1] != want[1] else "the row's seq_len")
            raise ValueError(f"{path}: hidden_states has shape {list(shape)} but {want} was "
                             f"expected (row {i}: [seq_len, len({LAYER_IDS_FIELD}="
                             f"{self.their_ids}), hidden_size]); check {field}")
        if not torch.equal(tokens.long(), self.table[i]["input_ids"].long()):
            raise ValueError(f"{path}: token_ids are not row {i}'s input_ids in {self.root}; the "
                             "states belong to another prepare-data output (set "
                             "data.hidden_states_path to the matching one)")

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> list[int]:
        """Tokens of every present row (what packing plans rows by)."""
        return [int(self.table[i]["input_ids"].shape[0]) for i in self.index]

    def tokens(self, k: int) -> dict[str, torch.Tensor]:
        """Item k's ``input_ids`` and ``loss_mask`` (no states read)."""
        row = self.table[self.index[k]]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].bool()}

    @torch.no_grad()
    def __getitem__(self, k: int) -> dict[str, Any]:
        i = self.index[k]
        with safe_open(str(self.states_dir / hs_file(i)), framework="pt") as f:
            states_snh = f.get_tensor("hidden_states")  # FP8 dequantised to bfloat16 as theirs do
            if FP8_SCALES_KEY in f.keys():  # noqa: SIM118 (safe_open: no __contains__)
                scales = f.get_tensor(FP8_SCALES_KEY)
                states_snh = states_snh.to(torch.bfloat16) * scales.to(torch.bfloat16)
        last_sh = states_snh[:, self.last_row]
        normed_sh = self.norm(last_sh.to(self.norm.weight.dtype))
        parts = [normed_sh.to(states_snh.dtype) if r < 0 else states_snh[:, r] for r in self.rows]
        argmax = chunked_argmax(self.lm_head, normed_sh.to(self.lm_head.weight.dtype)[None])[0]
        return {**self.tokens(k), "hidden": torch.cat(parts, dim=-1).contiguous(),
                "target_argmax": argmax, "target_last_hidden": normed_sh.to(states_snh.dtype),
                "sample_id": i}


def read_layer_ids(value: Any) -> list[int] | None:
    """``data.speculators_layer_ids`` as a list (null, a list, or a JSON list string)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = json.loads(value)
    return [int(v) for v in value]
