"""``dflash-eval backend=server``: acceptance, latency and throughput measured inside a serving
engine (vLLM or SGLang) instead of this package's own loop: the local eval's prompt ids go out one
request at a time with every sampling field explicit, and each :class:`ServerResponse` carries the
rounds and accepted drafts from vLLM's ``/metrics`` counters (read around the request) or
SGLang's ``/generate`` ``meta_info``; ``tau = (num_output_tokens - 1) / rounds`` beside the
engine's own ``engine_tau`` (docs/eval.md, "Through a serving engine").
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dflash_lab.serving.http import (
    CONNECTION_ERRORS,
    json_request,
    pick_served_model,
)
from dflash_lab.serving.settings import ServerSettings

BACKENDS = ("local", "server")
#: vLLM's speculative-decoding counters (Prometheus names without ``_total``).
VLLM_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens"}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


class EngineError(ValueError):
    """The engine is unreachable, refused a request, or does not report acceptance."""


@dataclass
class ServerResponse:
    """One response as the engine reports it. Seconds; ``rounds`` = verify rounds."""

    num_output_tokens: int
    rounds: int
    seconds: float
    output_ids: list[int] | None = None
    accepted_drafts: int | None = None  # vLLM: accepted drafts (also past the budget)
    draft_tokens: int | None = None
    #: rounds that accepted exactly j drafts, j = 0..B-1 (the engine's count, uncut)
    accepted_histogram: list[int] | None = None
    engine_tau: float | None = None  # the engine's own tokens per round (module docstring)
    ttft_s: float | None = None  # streaming only
    text: str | None = None  # the answer's text (multi-turn context when ids are missing)

    @property
    def tau(self) -> float | None:
        """Tokens kept per verify round, bonus included, prefill token apart."""
        return (self.num_output_tokens - 1) / self.rounds if self.rounds else None

    @property
    def tpot_s(self) -> float | None:
        """Decode seconds (after the first token) per output token, as the offline records
        (:mod:`dflash_lab.eval.records`, z-lab's time_per_output_token); streaming only."""
        if self.ttft_s is None or not self.num_output_tokens:
            return None
        return (self.seconds - self.ttft_s) / self.num_output_tokens

    def engine_fields(self) -> dict[str, Any]:
        """What the engine said beyond the record (report.json ``engine_responses``)."""
        return {k: v for k, v in vars(self).items() if k not in ("output_ids", "text")}


@dataclass(frozen=True)
class Sampling:
    """What one request asks for (the local eval's settings)."""

    max_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class SpecCounters:
    """A reading of vLLM's speculative-decoding counters, summed over engines and models."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: list[float] = field(default_factory=list)

    def minus(self, before: SpecCounters) -> SpecCounters:
        pos = [a - (before.per_pos[i] if i < len(before.per_pos) else 0.0)
               for i, a in enumerate(self.per_pos)]
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, pos)


def parse_vllm_metrics(text: str, where: str) -> SpecCounters:
    """vLLM's ``/metrics`` (Prometheus text) -> its spec-decode counters. A counter named
    ``X`` is exposed as ``X_total``; every label set (engine, model) is summed."""
    found: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).endswith("_total"):
            continue
        name, labels, value = m.group(1)[:-len("_total")], m.group(2) or "", float(m.group(3))
        if name == VLLM_PER_POS:
            pos = _POSITION.search(labels)
            if pos is not None:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in VLLM_COUNTERS.values():
            found[name] = found.get(name, 0.0) + value
    missing = [n for n in VLLM_COUNTERS.values() if n not in found]
    if missing:
        raise EngineError(
            f"{where} has no {', '.join(missing)}: the server was not started with speculative "
            "decoding (vllm serve TARGET --speculative-config '{\"method\": \"dflash\", "
            "\"model\": DRAFTER, \"num_speculative_tokens\": B-1}'), or it runs with "
            "--disable-log-stats")
    return SpecCounters(*(found[VLLM_COUNTERS[k]] for k in ("drafts", "draft_tokens", "accepted")),
                        [per_pos[i] for i in sorted(per_pos)])


def histogram_from_positions(drafts: float, per_pos: list[float]) -> list[int]:
    """vLLM's per-position counts (``per_pos[t]`` = rounds that accepted draft t, i.e. at least
    t + 1 drafts) -> rounds that accepted exactly j drafts, j = 0..len(per_pos)."""
    at_least = [drafts, *per_pos, 0.0]
    return [int(round(at_least[j] - at_least[j + 1])) for j in range(len(per_pos) + 1)]


def _sse_events(resp) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent-events stream (``data: {...}``), until ``[DONE]``."""
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class EngineClient:
    """Client of one served model; one request at a time (the vLLM counters need it)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.model = settings.model

    def _open(self, url: str, body: dict[str, Any] | None = None):
        """The open response of a GET (no body) or JSON POST; errors name the URL."""
        req = json_request(url, body, self.settings.api_key_env)
        try:
            return urllib.request.urlopen(req, timeout=self.settings.timeout_s)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:1000]  # the server's message
            raise EngineError(f"{url} answered HTTP {e.code}: {detail}") from None
        except CONNECTION_ERRORS as e:
            raise EngineError(
                f"could not reach {url} ({getattr(e, 'reason', e)}). Is the server up at "
                f"server.url={self.settings.url}? Start it (vllm serve TARGET --port 8000 "
                "--speculative-config ..., or python -m sglang.launch_server ...) or let "
                "dflash-eval start it with server.launch=[...]") from None

    def _json(self, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._open(url, body) as resp:
            return json.loads(resp.read())

    def counters(self) -> SpecCounters:
        """vLLM's spec-decode counters now (EngineError when the server has none)."""
        url = self.settings.root + "/metrics"
        with self._open(url) as resp:
            return parse_vllm_metrics(resp.read().decode(errors="replace"), url)

    def connect(self) -> dict[str, Any]:
        """Pick the served model, check the engine reports acceptance, find B: ``{"model", "root"
        (the served directory, where the server says), "block_size"}``."""
        card = pick_served_model(self._json(self.base + "/models").get("data") or [],
                                 self.model, self.base, "server.model", EngineError)
        self.model = card.get("id")
        return {"model": self.model, "root": card.get("root"),
                "block_size": self._engine_block_size()}

    def _engine_block_size(self) -> int:
        """B as the engine is configured: vLLM num_speculative_tokens + 1 (its per-position
        counters; a ``server.block_size`` that disagrees is refused), SGLang
        speculative_num_draft_tokens (``/get_server_info``), unless ``server.block_size``."""
        given = self.settings.block_size
        if self.settings.engine == "vllm":
            positions = len(self.counters().per_pos)
            if positions and given and given != positions + 1:
                raise EngineError(f"server.block_size={given} but {self.settings.root} serves "
                                  f"num_speculative_tokens={positions}, i.e. B={positions + 1} "
                                  "(vLLM counts the drafts, B - 1): drop server.block_size")
            if positions or given:
                return given or positions + 1
        elif given:
            return given
        else:
            info = self._json(self.settings.root + "/get_server_info")
            if info.get("speculative_num_draft_tokens"):
                return int(info["speculative_num_draft_tokens"])
        raise EngineError(f"{self.settings.root} does not say its draft block size: set "
                          "server.block_size=B (vLLM num_speculative_tokens + 1, SGLang "
                          "--speculative-num-draft-tokens)")

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> ServerResponse:
        """Decode one prompt (token ids) and return what the engine reports for it."""
        if self.settings.engine == "sglang":
            return self._sglang(prompt_ids, sampling)
        before = self.counters()
        resp = self._vllm_complete(prompt_ids, sampling)
        # vLLM records a step's stats in the turn that finishes the request: a response of 2+
        # tokens without a round reads the counters again, for up to settle_s
        deadline = time.monotonic() + self.settings.settle_s
        now = self.counters()
        while now.drafts == before.drafts and resp.num_output_tokens > 1 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.counters()
        delta = now.minus(before)
        resp.rounds = int(delta.drafts)
        resp.accepted_drafts, resp.draft_tokens = int(delta.accepted), int(delta.draft_tokens)
        resp.accepted_histogram = histogram_from_positions(delta.drafts, delta.per_pos)
        resp.engine_tau = 1 + delta.accepted / delta.drafts if delta.drafts else None
        return resp

    def _vllm_complete(self, prompt_ids: list[int], s: Sampling) -> ServerResponse:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos, "n": 1,
                "skip_special_tokens": True, "return_token_ids": True,
                "stream": self.settings.stream}
        if self.settings.stream:
            body["stream_options"] = {"include_usage": True}
        if s.seed is not None:
            body["seed"] = s.seed
        url = self.base + "/completions"
        start = time.perf_counter()
        if not self.settings.stream:
            answer = self._json(url, body)
            choice = answer["choices"][0]
            return ServerResponse(int(answer["usage"]["completion_tokens"]), 0,
                                  time.perf_counter() - start, choice.get("token_ids"),
                                  text=choice.get("text"))
        ids, texts, ttft, usage = [], [], None, None
        with self._open(url, body) as stream:
            for event in _sse_events(stream):
                for choice in event.get("choices") or []:
                    piece = choice.get("token_ids") or []
                    if ttft is None and (piece or choice.get("text")):
                        ttft = time.perf_counter() - start
                    ids.extend(piece)
                    texts.append(choice.get("text") or "")
                usage = event.get("usage") or usage
        if usage is None:
            raise EngineError(f"{url} streamed no usage (stream_options.include_usage)")
        return ServerResponse(int(usage["completion_tokens"]), 0, time.perf_counter() - start,
                              ids or None, ttft_s=ttft, text="".join(texts))

    def _sglang(self, prompt_ids: list[int], s: Sampling) -> ServerResponse:
        params = {"max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": 1.0,
                  "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                  "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
                  "skip_special_tokens": True}
        if s.seed is not None and s.temperature > 0:
            params["sampling_seed"] = s.seed
        url = self.settings.root + "/generate"
        body = {"input_ids": prompt_ids, "sampling_params": params,
                "stream": self.settings.stream}
        start = time.perf_counter()
        ttft, last, pieces = None, None, []
        if self.settings.stream:
            with self._open(url, body) as stream:
                for event in _sse_events(stream):
                    if ttft is None and event.get("meta_info", {}).get("completion_tokens"):
                        ttft = time.perf_counter() - start
                    pieces.append(event.get("output_ids") or [])
                    last = event
        else:
            last = self._json(url, body)
            pieces = [last.get("output_ids") or []]
        seconds = time.perf_counter() - start
        meta = (last or {}).get("meta_info") or {}
        if "spec_verify_ct" not in meta:
            raise EngineError(
                f"{url} answered without meta_info.spec_verify_ct: the server was not started "
                "with speculative decoding (python -m sglang.launch_server --model-path TARGET "
                "--speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER "
                "--speculative-num-draft-tokens B)")
        n = int(meta["completion_tokens"])
        # streamed output_ids are cumulative in some versions and incremental in others:
        # whichever has the reported length is kept
        joined = [t for p in pieces for t in p]
        ids = (pieces[-1] if pieces and len(pieces[-1]) == n
               else joined if len(joined) == n else None)
        accepted = meta.get("spec_num_correct_drafts", meta.get("spec_accept_token_num"))
        hist = meta.get("spec_acceptance_histogram")
        return ServerResponse(n, int(meta["spec_verify_ct"]), seconds, ids,
                              accepted_drafts=None if accepted is None else int(accepted),
                              accepted_histogram=[int(c) for c in hist] if hist else None,
                              engine_tau=meta.get("spec_accept_length"), ttft_s=ttft,
                              text=(last or {}).get("text"))
