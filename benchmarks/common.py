"""Shared benchmark plumbing: device choice, timing, peak memory, matmul peak, result output.

Every benchmark measures the things it compares in the SAME run (interleaved where it matters)
and prints ratios; absolute numbers depend on the machine and on whatever else runs on it.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` after a reset; on CPU the kernel's
resident-set high-water mark (``VmHWM``), reset by writing ``5`` to ``/proc/self/clear_refs``
(Linux >= 4.0), with glibc's mmap threshold pinned at 128 KiB (``--allocator pinned``) so freed
tensors leave the resident set and the high-water mark measures the step's own peak. Where the
reset is not allowed a sampling thread polls the RSS instead (coarser; the output says which).

The pinned allocator makes every large CPU allocation a fresh, page-faulting mapping: ~20% of a
training step at the ``cpu`` size. Benchmarks whose point is step time (train_step,
peer_speculators) therefore time under glibc's default allocator, as a training run has it, and
take CPU peaks in a separate pinned process (:func:`pinned_child`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import re
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MiB = 1024 * 1024

# Known, harmless here: flex's return_lse deprecation and its "unfused on CPU" notice (the CPU
# flex path is the forward-only reference; CUDA compiles the kernel).
warnings.filterwarnings("ignore", message="return_lse is deprecated")
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


_ALLOCATOR = {"mode": "default"}


def pin_malloc_thresholds() -> None:
    """Make glibc serve every block >= 128 KiB with mmap and give freed heap tops back, so the
    resident set follows live tensors (glibc otherwise raises its mmap threshold after the first
    big free and keeps freed memory resident, hiding later peaks). The price: every large
    allocation is a fresh mapping that page-faults in, ~20% of a CPU training step here."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (a fixed value stops the adjustment)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        _ALLOCATOR["mode"] = "pinned"


def base_parser(description: str, allocator: str = "pinned") -> argparse.ArgumentParser:
    """The flags every benchmark shares. ``allocator``: this benchmark's default for
    ``--allocator`` (pinned where peak memory is the point, default where step time is)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")
    p.add_argument("--size", default=None,
                   help="toy (smoke test) | cpu | paper; default: paper on CUDA, cpu otherwise")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default per size)")
    p.add_argument("--allocator", default=allocator, choices=["pinned", "default"],
                   help="CPU only. pinned: glibc mmap threshold fixed at 128 KiB, so the "
                        "resident-set peak measures live tensors (slower: page faults); default: "
                        f"glibc as a training run has it (CPU peaks not measured). Default: "
                        f"{allocator}")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p


def resolve(args: argparse.Namespace) -> tuple[torch.device, str]:
    """(device, size) from the parsed flags."""
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA GPU (use --device cpu)")
    size = args.size or ("paper" if name == "cuda" else "cpu")
    if size not in ("toy", "cpu", "paper"):
        raise SystemExit(f"--size {size!r}: use toy | cpu | paper")
    if getattr(args, "allocator", "default") == "pinned":
        pin_malloc_thresholds()
    return torch.device(name), size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1,
            ) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------- peak memory
def _rss_kib() -> int:
    return _status_kib("VmRSS")


def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1))


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


UNMEASURED = "not measured (CPU peaks need --allocator pinned)"


@dataclass
class Peak:
    """Filled by :func:`peak_memory`: bytes above the level at entry, and the method used."""

    bytes: int = 0
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mib(self) -> float:
        return self.bytes / MiB if self.method != UNMEASURED else float("nan")


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[Peak]:
    """Peak memory allocated inside the block, above what was allocated at entry."""
    peak = Peak()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield peak
        sync(device)
        peak.bytes = torch.cuda.max_memory_allocated(device) - start
        peak.method = "cuda max_memory_allocated"
        return
    if _ALLOCATOR["mode"] != "pinned":  # freed memory stays resident and gets reused unseen
        yield peak
        peak.method = UNMEASURED
        return
    start = _rss_kib()
    if _reset_hwm():
        yield peak
        peak.bytes = max(0, _status_kib("VmHWM") - start) * 1024
        peak.method = "cpu VmHWM (reset via clear_refs)"
        return
    highest = [start]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            highest[0] = max(highest[0], _rss_kib())
            time.sleep(0.001)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
    peak.bytes = max(0, max(highest[0], _rss_kib()) - start) * 1024
    peak.method = "cpu RSS sampled every 1 ms"


def pinned_child(module: str, argv: list[str]) -> dict[str, Any]:
    """Run ``python -m module *argv --allocator pinned`` and return the JSON object it prints
    last: how a time-focused benchmark gets CPU peak memory without slowing its own steps."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", module, *argv, "--allocator", "pinned"],
                          cwd=root, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- machine
def matmul_peak_flops(device: torch.device, dtype: torch.dtype | None = None,
                      n: int | None = None, repeats: int = 5) -> tuple[float, str]:
    """Measured dense matmul throughput (FLOP/s) of this machine now: the MFU denominator."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 1536)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sec = time_it(lambda: a @ b, device, repeats, warmup=2)
    return 2 * n**3 / sec, f"{n}x{n} @ {n}x{n} {str(dtype).removeprefix('torch.')}"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------- output
def report(name: str, args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """Print the machine line and write ``--json`` if asked; returns the full record."""
    record = {"benchmark": name, "machine": machine(), **results}
    m = record["machine"]
    print(f"[{name}] torch {m['torch']} | {m.get('gpu', m['cpu'])} | "
          f"{m['torch_threads']} threads | load {m.get('loadavg_1m', '?')}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain aligned table on stdout."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---------------------------------------------------------------------------- shapes
#: Drafter shapes (DrafterConfig fields) and run dimensions per size. ``cpu`` is a SmolLM2-135M
#: drafter (the CPU end-to-end recipe's shape); ``paper`` the Qwen3-8B paper drafter and layout.
SHAPES: dict[str, dict[str, Any]] = {
    "toy": dict(
        config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                    mask_token_id=511, num_target_layers=8, target_layer_ids=[1, 3, 5],
                    block_size=4),
        seq_len=64, num_anchors=8, batch=1, dtype=torch.float32),
    "cpu": dict(
        config=dict(hidden_size=576, num_hidden_layers=3, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, mask_token_id=16, num_target_layers=30,
                    target_layer_ids=[1, 8, 14, 21, 27], block_size=8, rms_norm_eps=1e-5,
                    rope_theta=100000.0),
        seq_len=512, num_anchors=32, batch=1, dtype=torch.float32),
    "paper": dict(
        config=dict(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                    vocab_size=151936, mask_token_id=151669, num_target_layers=36,
                    target_layer_ids=[1, 9, 17, 25, 33], block_size=16, rms_norm_eps=1e-6,
                    rope_theta=1000000.0),
        seq_len=3072, num_anchors=512, batch=1, dtype=torch.bfloat16),
}


# ---------------------------------------------------------------------------- heads
#: conf/drafter keys that are no head setting (the backbone's shape comes from ``SHAPES``).
NOT_HEAD_FIELDS = ("_target_", "backend", "init_from", "verify_checksums", "defaults")


def _composed(path: Path) -> dict[str, Any]:
    """A Hydra config file with its ``defaults`` list merged in order (plain names of the same
    folder, and ``_self_``; ``override /group: x`` entries are skipped): the file as Hydra
    composes it within its own group, without Hydra."""
    from omegaconf import OmegaConf

    own = OmegaConf.load(path)
    names = [d for d in own.get("defaults", []) if isinstance(d, str)]
    merged = OmegaConf.create()
    for name in names if "_self_" in names else [*names, "_self_"]:
        part = own if name == "_self_" else _composed(path.parent / f"{name}.yaml")
        merged = OmegaConf.merge(merged, part)
    out = OmegaConf.to_container(merged, resolve=True)
    out.pop("defaults", None)
    return out


def head_names() -> list[str]:
    """dflash1 (conf/drafter/default.yaml) and every conf/drafter/NAME.yaml that sets a
    ``variant`` (laguna.yaml sets backbone features, no head), in file-name order."""
    from dflash_lab.paths import CONF_DIR

    files = sorted((CONF_DIR / "drafter").glob("*.yaml"))
    return ["dflash1", *(f.stem for f in files if "variant" in _composed(f))]


def head_fields(name: str) -> dict[str, Any]:
    """The DrafterConfig fields conf/drafter/NAME.yaml sets beyond default.yaml (the one source
    of a head's settings); a field it leaves null (LiLiCorr's lattice: no engine defaults it)
    is taken from the head's tiny recipe, recipes/tiny_cpu_NAME.yaml, where that sets it."""
    from dflash_lab.paths import CONF_DIR, RECIPES_DIR

    if name == "dflash1":
        return {}
    path = CONF_DIR / "drafter" / f"{name}.yaml"
    if name not in head_names():
        raise ValueError(f"head {name!r}: no conf/drafter/{name}.yaml sets a variant "
                         f"(heads: {head_names()})")
    base, own = _composed(CONF_DIR / "drafter" / "default.yaml"), _composed(path)
    fields = {k: v for k, v in own.items()
              if k not in NOT_HEAD_FIELDS and (k not in base or v != base[k])}
    recipe = RECIPES_DIR / f"tiny_cpu_{name}.yaml"
    tiny = _composed(recipe).get("drafter", {}) if recipe.is_file() else {}
    return {k: tiny.get(k) if v is None else v for k, v in fields.items()
            if v is not None or tiny.get(k) is not None}


def teacher_batch(batch: dict, head, seed: int = 1, topk: int = 64) -> dict:
    """The batch with a target distribution: last hidden states [Bt, S, H] (unit scale, as a
    final norm leaves them) and their top-``topk`` ids / log-probabilities through ``head``."""
    g = torch.Generator().manual_seed(seed)
    bt, s = batch["input_ids"].shape
    last = torch.randn(bt, s, head.lm_head.weight.shape[1], generator=g)
    last = (last * 8.0).to(batch["hidden"].device, batch["hidden"].dtype)  # peaked logits
    with torch.no_grad():
        logp = head.lm_head(last).float().log_softmax(-1)
        values, ids = logp.topk(topk, dim=-1)
    return {**batch, "target_last_hidden": last, "target_top_ids": ids,
            "target_top_logprobs": values}


def product_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer ``conf/module/default.yaml`` selects (its ``optimizer`` defaults group,
    ``conf/module/optimizer/<choice>.yaml``), built without Hydra (the GPU
    machine has none), so benchmarks time what a training run steps (fused AdamW)."""
    import yaml

    from dflash_lab.paths import CONF_DIR

    module_path = CONF_DIR / "module" / "default.yaml"
    defaults = yaml.safe_load(module_path.read_text()).get("defaults", [])
    choice = next((d["optimizer"] for d in defaults if isinstance(d, dict) and "optimizer" in d),
                  None)
    if choice is None:
        raise ValueError(f"{module_path}: no `optimizer:` entry in its defaults list; "
                         "benchmarks/common.py reads the optimizer group from there")
    path = CONF_DIR / "module" / "optimizer" / f"{choice}.yaml"
    spec = dict(yaml.safe_load(path.read_text()))
    target = spec.pop("_target_")
    spec.pop("_partial_", None)
    if target != "torch.optim.AdamW":
        raise ValueError(f"{path}: optimizer {target!r}; benchmarks/common.py builds only "
                         "torch.optim.AdamW: extend product_optimizer() for the new optimizer")
    return torch.optim.AdamW(params, **spec)


def drafter_config(size: str, **overrides: Any):
    """The benchmark DrafterConfig of a size (all layers full bidirectional unless overridden)."""
    from dflash_lab.model.config import DrafterConfig

    fields = {**SHAPES[size]["config"], **overrides}
    return DrafterConfig.create(source=f"benchmarks SHAPES[{size!r}]", **fields)


def target_head(config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Frozen random embedding + LM head of the drafter's width and vocab (a stand-in target)."""
    from torch import nn

    from dflash_lab.targets.target import TargetPieces

    g = torch.Generator().manual_seed(seed)
    v, h = config.vocab_size, config.hidden_size
    embed = nn.Embedding(v, h)
    lm_head = nn.Linear(h, v, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(v, h, generator=g) * 0.02)
        lm_head.weight.copy_(torch.randn(v, h, generator=g) * 0.02)
    pieces = TargetPieces(embed, nn.Identity(), lm_head)
    return pieces.to(device=device, dtype=dtype)


def training_batch(config, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                   batch: int | None = None, seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """A random batch in the data module's contract (every position in the loss mask)."""
    g = torch.Generator().manual_seed(seed)
    bt = batch or SHAPES[size]["batch"]
    s = seq_len or SHAPES[size]["seq_len"]
    f = config.num_features
    return {
        "hidden": torch.randn(bt, s, f, generator=g).to(device, dtype),
        "input_ids": torch.randint(0, config.vocab_size - 1, (bt, s), generator=g).to(device),
        "target_argmax": torch.randint(0, config.vocab_size - 1, (bt, s), generator=g).to(device),
        "loss_mask": torch.ones(bt, s, dtype=torch.long, device=device),
    }
