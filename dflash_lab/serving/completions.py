"""A running vLLM or SGLang server as the generator of on-policy replies (dflash-regenerate),
through the OpenAI-compatible ``/v1/completions``: prompts as token ids rendered here, every
sampling field explicit, the target's end-of-turn ids as stops, the reply's token ids decoded
here; transient failures retried with backoff, stdlib ``urllib`` only (docs/capture.md,
"Through a running vLLM or SGLang server").
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dflash_lab.errors import UserError
from dflash_lab.serving.http import (
    CONNECTION_ERRORS,
    json_request,
    pick_served_model,
)
from dflash_lab.serving.launch import client_of
from dflash_lab.serving.settings import ServerSettings

log = logging.getLogger("dflash_lab.regenerate")

#: HTTP statuses worth retrying: rate limiting and server-side failures.
_RETRY_STATUS = {429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Reply:
    """One completion: its text (without the stop token), generated tokens, and the generated
    ids when the server returns them (``return_token_ids``)."""

    text: str
    num_tokens: int
    token_ids: list[int] | None = None


class ServerError(UserError, RuntimeError):
    """The server could not be reached or refused a request (message says what to do)."""


class CompletionServer:
    """Client of one served model; thread-safe (each request opens its own connection)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.model = settings.model

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET (no body) or POST JSON with retries on transient failures; the decoded answer."""
        s = self.settings
        last: Exception | None = None
        for attempt in range(s.retries + 1):
            if attempt:
                time.sleep(2 ** (attempt - 1))
            req = json_request(self.base + path, body, s.api_key_env)
            try:
                with urllib.request.urlopen(req, timeout=s.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:2000]  # the server's message
                if e.code not in _RETRY_STATUS:
                    hint = ("" if e.code != 404 else " (no such path: is server.url the "
                            "OpenAI-compatible API base of a vLLM or SGLang server, ending in "
                            "/v1, e.g. http://HOST:8000/v1?)")
                    raise ServerError(f"{self.base}{path} refused the request (HTTP {e.code})"
                                      f"{hint}: {detail}") from None
                last = ServerError(f"HTTP {e.code}: {detail}")
            except CONNECTION_ERRORS as e:
                last = e
            log.warning("%s%s: attempt %d/%d failed (%s)", self.base, path, attempt + 1,
                        s.retries + 1, last)
        raise ServerError(
            f"{self.base}{path} failed {s.retries + 1} times (last: {last}). Is the server up? "
            "e.g. `vllm serve TARGET_DIR --port 8000` or `python -m sglang.launch_server "
            "--model-path TARGET_DIR --port 8000`, then server.url="
            "http://HOST:PORT/v1. Finished parts are kept: rerun the same command to resume.")

    def connect(self, max_length: int,
                setting: str = "regenerate.settings.max_length") -> dict[str, Any]:
        """Pick the served model and check it holds ``max_length`` tokens (``setting``: the key an
        error names). Returns the model id and, where the server says (vLLM, SGLang), its root
        path and max_model_len (else None)."""
        card = pick_served_model(self._request("/models").get("data") or [], self.model,
                                 self.base, "server.model", ServerError)
        self.model = card.get("id")
        max_model_len = card.get("max_model_len")
        if max_model_len is not None and max_length > max_model_len:
            raise ValueError(f"{setting}={max_length} exceeds the server's "
                             f"max_model_len={max_model_len}: lower max_length or restart the "
                             "server with a larger --max-model-len / --context-length")
        return {"model": self.model, "root": card.get("root"), "max_model_len": max_model_len}

    def complete(self, prompt_ids: list[int], *, max_tokens: int, temperature: float,
                 top_p: float, stop_token_ids: list[int], seed: int | None) -> Reply:
        """One completion of a token-id prompt with exactly these sampling settings."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p if temperature > 0 else 1.0,
                "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "stop_token_ids": stop_token_ids, "skip_special_tokens": True, "n": 1,
                "stream": False, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        answer = self._request("/completions", body)
        try:
            choice = answer["choices"][0]
            ids = choice.get("token_ids")
            return Reply(choice["text"], int(answer["usage"]["completion_tokens"]),
                         [int(i) for i in ids] if ids is not None else None)
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{self.base}/completions answered without choices[0].text and "
                              f"usage.completion_tokens: {str(answer)[:500]}") from None

    def complete_many(self, prompts: list[list[int]], seeds: list[int | None],
                      **sampling: Any) -> list[Reply]:
        """``complete`` for every prompt at once (the server batches them), results in input
        order; a failure or Ctrl-C returns at once (:func:`all_at_once`)."""
        return all_at_once([partial(self.complete, p, seed=seed, **sampling)
                            for p, seed in zip(prompts, seeds)], "regen")


def all_at_once(calls: list[Callable[[], Any]], name: str) -> list[Any]:
    """Every call in flight at once (threads ``name``), results in input order; the first failure
    or Ctrl-C cancels the unstarted calls and returns at once (in-flight results discarded)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(calls)), thread_name_prefix=name)
    try:
        futures = [pool.submit(call) for call in calls]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:  # at once, not after the requests still in flight
            raise failed[0].exception()
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def open_server(settings: ServerSettings, log_path: Path, world_size: int = 1
                ) -> AbstractContextManager[CompletionServer]:
    """A client of the server at ``settings.url``, or, with ``settings.launch``, of a server
    started for the block (its output in ``log_path``) and stopped after it."""
    return client_of(settings, log_path, CompletionServer, world_size)
