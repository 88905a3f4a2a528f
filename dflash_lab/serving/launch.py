"""Start an OpenAI-compatible server (``server.launch``, any engine, ``{port}`` a free local port)
for the length of a ``with`` block, then stop it however the run ends; its output goes to a log
whose tail an early exit shows (docs/capture.md, "Through a running vLLM or SGLang server").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

PORT = "{port}"
log = logging.getLogger(__name__)
Client = TypeVar("Client")


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


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def launched_server(command: Sequence[str], log: Path, *, start_timeout_s: float = 1800.0,
                    env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``command`` (``{port}``: a free port) for the block; yields the API base
    ``http://127.0.0.1:PORT/v1`` once ``/v1/models`` lists a model. ValueError: no ``{port}`` or
    no such program; RuntimeError (the log's tail): exited or not ready in ``start_timeout_s``."""
    if not command or not any(PORT in str(part) for part in command):
        raise ValueError(f"server.launch={list(command)!r} must contain {PORT} where "
                         "the server takes its port, e.g. [vllm, serve, /models/X, --port, "
                         "'{port}']")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    argv = [str(part).replace(PORT, str(port)) for part in command]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        except OSError as e:  # e.g. a misspelt or uninstalled program: the user's input
            raise ValueError(f"server.launch: could not start {argv[0]!r} ({e.strerror}); "
                             f"the command was {argv}. Fix: the first item must be a program "
                             "on PATH or its full path, e.g. [vllm, serve, /models/X, --port, "
                             "'{port}'] or [/path/to/.venv-vllm/bin/vllm, ...]") from None
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready: "
                                   f"{argv}\n{log}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {start_timeout_s:.0f} s: "
                                   f"{argv}\n{log}:\n{log_tail(log)}")
            time.sleep(1)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
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


@contextmanager
def client_of(settings: Any, log_path: Path, make: Callable[[Any], Client], world_size: int = 1,
              argv: Callable[[list[str]], list[str]] = list, env: dict[str, str] | None = None,
              ) -> Iterator[Client]:
    """``make(settings)``: a client of the server at ``settings.url``, or, with
    ``settings.launch``, of one started for the block (command ``argv(launch)``, extra ``env``,
    output in ``log_path``), then stopped; one server per process (``world_size`` > 1 refused)."""
    if settings.launch is None:
        yield make(settings)
        return
    if world_size > 1:
        raise ValueError("server.launch starts one server per process; with "
                         f"WORLD_SIZE={world_size} start the server yourself and pass server.url")
    with launched_server(argv(list(settings.launch)), log_path, env=env,
                         start_timeout_s=settings.start_timeout_s) as url:
        log.info("server ready at %s (its output: %s)", url, log_path)
        yield make(replace(settings, url=url))
