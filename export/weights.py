"""The serving weight layout (dflash.md section 4; docs/export.md, "What is written", "DFlash 2
drafters"): names, shapes, dtype casts, file I/O, and ``SHA256SUMS`` over every other file,
written last and checked by every reader unless :data:`OVERRIDES` turn it off
(docs/guarantees.md, "Damaged files").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_lab.checksums import sha256_file
from dflash_lab.dtypes import DTYPES  # noqa: F401  (re-exported: api.py, cli.py)
from dflash_lab.model.config import DrafterConfig

WEIGHTS_FILE = "model.safetensors"
#: HF's sharded form: {"weight_map": {tensor name: shard file in the same directory}}
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MASK_FILE = "mask_embedding.pt"
MASK_KEY = "mask_embedding"  #: the drafter's state_dict key for the learned mask embedding
SINK_SUFFIX = "self_attn.attention_sink_bias"
#: DFlash 2's codebooks (heads/dflash2.py), which z-lab's save_pretrained suffixes '.weight'
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
#: z-lab ``save_pretrained`` name -> serving name (vLLM refuses the former, SGLang skips it)
SUFFIXED_CODEBOOKS = {f"{name}.weight": name for name in CODEBOOKS}


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every serving tensor name -> shape, for ``config`` (mask embedding excluded): the
    backbone's, then each head's and feature's own (``Head.weight_shapes``)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, \
        config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, config.num_features),
        "hidden_norm.weight": (h,), "norm.weight": (h,),
    }
    proj = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    rest = {"mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
            "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes.update({f"{p}self_attn.{n}.weight": (d,) for n in ("q_norm", "k_norm")})
        if config.attention_sink_bias:
            shapes[f"{p}{SINK_SUFFIX}"] = (config.num_attention_heads,)
        shapes.update({f"{p}{name}.weight": shape for name, shape in rest.items()})
    for part in config.parts:  # the head's and the features' tensors (model/heads.py)
        shapes.update(part.weight_shapes(config))
    return shapes


def own_head(config: DrafterConfig) -> bool:
    """A reduced draft vocabulary (N < V): the drafter ships its own head and vLLM's id maps."""
    return config.draft_vocab_size is not None and config.draft_vocab_size < config.vocab_size


def check_draft_vocab(state: dict[str, torch.Tensor], config: DrafterConfig, source: str) -> None:
    """``d2t`` [N] (offsets: target id = i + d2t[i]) and ``t2d`` [V] (bool) name the same N
    distinct in-vocabulary target ids, ascending: vLLM's ``compute_logits`` scatters by them."""
    if not own_head(config):
        return
    d2t, t2d = state["d2t"], state["t2d"]
    if d2t.is_floating_point() or t2d.dtype != torch.bool:
        raise ValueError(f"{source}: d2t must be integer offsets and t2d bool, got {d2t.dtype} "
                         f"and {t2d.dtype}; re-export the drafter")
    ids = torch.arange(d2t.numel()) + d2t.long().cpu()
    ok = (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0
          and int(ids[-1]) < config.vocab_size)
    if not ok or not torch.equal(t2d.cpu().nonzero().flatten(), ids if ok else ids[:0]):
        raise ValueError(f"{source}: d2t and t2d do not name the same {d2t.numel()} distinct "
                         f"target ids in [0, {config.vocab_size}); was the draft vocabulary "
                         "chosen (dflash-train sets it before training)? Re-export the drafter")


def serving_names(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename z-lab ``save_pretrained`` codebook names (``...codebook.weight``) to the serving
    names; returns the renamed dict and the names that were renamed."""
    renamed = [k for k in state if k in SUFFIXED_CODEBOOKS]
    return {SUFFIXED_CODEBOOKS.get(k, k): v for k, v in state.items()}, renamed


def split_mask_embedding(state: dict[str, torch.Tensor], config: DrafterConfig,
                         source: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Separate the learned mask embedding (its own file) from the safetensors weights."""
    state = dict(state)
    mask = state.pop(MASK_KEY, None)
    if config.learned_mask_embedding and mask is None:
        raise ValueError(f"{source}: config says learned_mask_embedding but the weights have no "
                         f"'{MASK_KEY}' tensor; was the checkpoint saved from this drafter?")
    if mask is not None and not config.learned_mask_embedding:
        raise ValueError(f"{source}: weights carry '{MASK_KEY}' but the config does not set "
                         "learned_mask_embedding; fix the drafter_config hyper-parameter")
    if mask is not None and mask.numel() != config.hidden_size:
        raise ValueError(f"{source}: '{MASK_KEY}' has shape {tuple(mask.shape)}, expected "
                         f"[{config.hidden_size}]")
    return state, (mask.reshape(-1) if mask is not None else None)


def validate_state_dict(state: dict[str, torch.Tensor], config: DrafterConfig,
                        source: str) -> None:
    """Exact key set and shapes, so a drafter/contract drift fails here, not in an engine."""
    want = expected_shapes(config)
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the drafter config: missing "
                         f"{missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected "
                         f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    bad = [f"{k}: {tuple(state[k].shape)} != {want[k]}" for k in want
           if tuple(state[k].shape) != want[k]]
    if bad:
        raise ValueError(f"{source}: wrong tensor shapes: {bad[:8]}")
    check_draft_vocab(state, config, source)
    broken = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if broken:
        raise ValueError(f"{source}: tensors with NaN/inf values: {broken[:8]}; the checkpoint "
                         "holds uninitialised or diverged weights")


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, floating tensors in ``dtype`` (safetensors refuses views sharing
    storage); integer and bool tensors (the draft vocabulary's ``d2t`` / ``t2d``) keep theirs."""
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
            .contiguous().clone() for k, v in state.items()}


def save_weights(out_dir: Path, state: dict[str, torch.Tensor], mask: torch.Tensor | None,
                 mask_token_id: int) -> None:
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    if mask is not None:
        torch.save({"embedding": mask, "mask_token_id": mask_token_id}, out_dir / MASK_FILE)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a serving directory: ``model.safetensors``, else the shards that
    ``model.safetensors.index.json`` names (each once, sorted); [] when it has neither.
    ValueError for an index that is not one, or that names a shard outside the directory or not
    in it: such a directory cannot be read whole, and a partial read would drop tensors."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({str(v) for v in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err}); it "
                         "needs a 'weight_map' of tensor name -> shard file") from err
    outside = [s for s in shards if Path(s).name != s]
    if outside:
        raise ValueError(f"{index} names shard(s) outside {path}: {outside[:4]}; a shard must be "
                         "a file name in the same directory")
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise ValueError(f"{index} names {len(missing)} shard(s) that are not in {path}: "
                         f"{missing[:4]}; copy them there (or download the whole directory)")
    return [path / s for s in shards]


def has_weights(path: Path) -> bool:
    """Whether the directory ships weights (one file or an index with its shards)."""
    return bool(weight_files(path))


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every weight file, from the headers (no tensor is loaded:
    cheap, for --inspect). ValueError: a name in two shards, or the index lists other names."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                if k in shapes:
                    raise ValueError(f"{path}: tensor {k} is in two weight shards "
                                     f"({file.name} and another); the directory is corrupt")
                shapes[k] = tuple(f.get_slice(k).get_shape())
    index = Path(path) / WEIGHTS_INDEX
    if not (Path(path) / WEIGHTS_FILE).is_file() and index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        if listed != set(shapes):
            raise ValueError(f"{index} and its shards disagree: only in the index "
                             f"{sorted(listed - set(shapes))[:4]}, only in the shards "
                             f"{sorted(set(shapes) - listed)[:4]}; re-download the directory")
    return shapes


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory (one file or all shards), on the CPU."""
    weight_shapes(path)  # refuses duplicate names and an index that disagrees with its shards
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state.update(load_file(str(file), device="cpu"))
    return state


def draft_vocab_problems(path: Path, config: DrafterConfig) -> tuple[list[str], list[str]]:
    """(lines, problems) of a directory's draft vocabulary for ``--inspect``: N of V, and
    whether ``d2t`` / ``t2d`` name the same ids (:func:`check_draft_vocab`)."""
    if not own_head(config):
        return [], []
    lines = [f"draft vocabulary: {config.draft_vocab_size} of {config.vocab_size} target tokens "
             "(the drafter's own lm_head; vLLM scatters its logits by d2t)"]
    if not {"d2t", "t2d"} <= set(weight_shapes(path)):
        return lines, []  # the shape check names the missing tensors
    state = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in ("d2t", "t2d") if k in f.keys()})  # noqa: SIM118
    try:
        check_draft_vocab(state, config, str(path / WEIGHTS_FILE))
    except ValueError as err:
        return lines, [str(err)]
    return lines, []


def load_mask_file(path: Path, mask_token_id: int | None) -> torch.Tensor | None:
    """Read ``mask_embedding.pt`` in either form vLLM accepts; never unpickles objects."""
    file = path / MASK_FILE
    if not file.exists():
        return None
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{file}: not a plain tensor file ({err}); re-export it") from err
    if isinstance(data, dict):
        stored = data.get("mask_token_id", mask_token_id)
        if mask_token_id is not None and stored != mask_token_id:
            raise ValueError(f"{file}: mask_token_id {stored} differs from "
                             f"dflash_config.mask_token_id {mask_token_id} (vLLM refuses this)")
        data = data["embedding"]
    return data.reshape(-1)


@dataclass
class Source:
    """A drafter ready to export: config, serving-layout weights (+ ``mask_embedding``)."""

    config: DrafterConfig
    state_dict: dict[str, torch.Tensor]
    kind: str  #: "checkpoint" | "serving"
    description: str
    notes: list[str] = field(default_factory=list)
    reads: list[Path] = field(default_factory=list)  #: files/dirs read (never an OUT_DIR)
    #: The target identity a training checkpoint recorded (``dflash_target``: config/tokenizer
    #: hashes and ``weights_fingerprint``), or our export's ``dflash_lab_target``; None for
    #: third-party directories, older checkpoints and older exports.
    target_identity: dict | None = None
    #: False when the format records no target depth (speculators, a z-lab config without
    #: ``num_target_layers``): ``config.num_target_layers`` is then max(ids) + 1, assumed.
    depth_recorded: bool = True
    #: Where our mask runs these weights differently from their trainer's (read from the
    #: format; the warm start reports them with the override contradictions).
    mask_differences: list[str] = field(default_factory=list)
    #: False when the format records no vocabulary (Muse Glimmer): ``config.vocab_size`` is a
    #: placeholder the consumer replaces with the target's (:func:`with_target_vocab`)
    vocab_recorded: bool = True


def plain_key(key: str) -> str:
    """Drop torch.compile's ``_orig_mod`` wrapper level (the training module may compile the
    draft layers, which renames ``layers.0.x`` to ``layers.0._orig_mod.x``)."""
    return key.replace("._orig_mod.", ".").removeprefix("_orig_mod.")


# ---------------------------------------------------------------------- checksums (SHA256SUMS)
CHECKSUMS_FILE = "SHA256SUMS"
#: How each reader turns verification off (named in every refusal).
OVERRIDES = ("dflash-export --no-verify", "dflash-eval drafter.verify_checksums=false",
             "dflash-train drafter.verify_checksums=false")


def write_checksums(directory: Path) -> Path:
    """Write ``SHA256SUMS`` over every other regular file of ``directory`` (sorted by name)."""
    directory = Path(directory)
    lines = [f"{sha256_file(p)}  {p.name}\n" for p in sorted(directory.iterdir())
             if p.is_file() and p.name != CHECKSUMS_FILE]
    path = directory / CHECKSUMS_FILE
    path.write_text("".join(lines), encoding="utf-8")
    return path


@dataclass
class Verification:
    """``status``: ``verified`` | ``unrecorded`` (no SHA256SUMS) | ``failed`` | ``skipped``;
    ``problems``: each file that differs, is missing, or is not listed, by name."""

    status: str
    problems: list[str]
    files: int = 0
    extra: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """One line for a reader's notes."""
        added = (f"; not in the record, not checked: {', '.join(self.extra)}" if self.extra
                 else "")
        return {"verified": f"{CHECKSUMS_FILE} verified ({self.files} files{added})",
                "unrecorded": f"no {CHECKSUMS_FILE} (not written by dflash-export, or by an "
                              "older one): files not verified",
                "skipped": f"{CHECKSUMS_FILE} not checked (verification turned off)",
                }.get(self.status, f"{CHECKSUMS_FILE} check failed: " + "; ".join(self.problems))


def _listed(path: Path) -> dict[str, str]:
    """{file name: hex digest} of a SHA256SUMS file; ValueError naming a malformed line."""
    listed = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            raise ValueError(f"{path}, line {number}: expected '<sha256>  <file name>', got "
                             f"{line[:80]!r}")
        listed[name.lstrip("*")] = digest.lower()
    return listed


def verify_dir(directory: Path, absent_ok: tuple[str, ...] = ()) -> Verification:
    """Check ``directory`` against its ``SHA256SUMS``: every listed file must exist with that
    digest (``absent_ok``: listed files that may be missing, e.g. the weights when only
    config.json is inspected). Files added beside them (a README for a model hub) are not what
    an engine loads from an export; they are named in ``extra``, not refused."""
    directory = Path(directory)
    record = directory / CHECKSUMS_FILE
    if not record.is_file():
        return Verification("unrecorded", [])
    try:
        listed = _listed(record)
    except ValueError as err:
        return Verification("failed", [str(err)])
    problems = []
    for name, want in listed.items():
        path = directory / name
        if not path.is_file():
            if name not in absent_ok:
                problems.append(f"{name} is missing")
        elif sha256_file(path) != want:
            problems.append(f"{name} differs from its recorded sha256 (changed or damaged "
                            "after the export)")
    extra = tuple(sorted(p.name for p in directory.iterdir()
                         if p.is_file() and p.name != CHECKSUMS_FILE and p.name not in listed))
    return Verification("failed" if problems else "verified", problems, len(listed), extra)


def checked(directory: Path, verify: bool = True) -> Verification:
    """:func:`verify_dir`, or ``skipped`` when ``verify`` is off; ValueError naming each file
    that differs (and how to read a hand-edited directory anyway) when the check fails."""
    if not verify:
        return Verification("skipped", [])
    result = verify_dir(directory)
    if result.status == "failed":
        raise ValueError(f"serving directory {directory}: " + "; ".join(result.problems)
                         + f". Re-export it from its checkpoint, or, for a directory you edited "
                         f"on purpose, turn the check off ({', '.join(OVERRIDES)})")
    return result
