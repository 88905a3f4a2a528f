"""A stand-in for vLLM's OpenAI-compatible server: /v1/models and /v1/completions (token-id
prompts) answered by a transformers model one request at a time, with vLLM's semantics for
stops, text and token counts, and hooks to inject failures and delays.

Imported by tests/test_regenerate_server.py; also runnable, so ``regenerate.server.launch`` can
start it as a server process:

    python tests/fake_openai_server.py --target DIR --port PORT
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

MODEL_ID = "tiny-target"


class FakeEngine:
    """What the handler serves: the target, the requests seen, failures to inject."""

    def __init__(self, target, max_model_len=4096, models=(MODEL_ID,)):
        self.target, self.max_model_len, self.models = target, max_model_len, list(models)
        self.requests: list[dict] = []
        self.fail_next: list[tuple[int, str]] = []  # (HTTP status, message), served in order
        self.returns_token_ids = True  # False: an engine that ignores return_token_ids
        self.delay_s = 0.0  # answer successful requests this late
        self.reject: dict[tuple, tuple[int, str]] = {}  # prompt ids -> (HTTP status, message)
        self.lock = threading.Lock()

    def complete(self, body: dict) -> dict:
        """vLLM's semantics: stop at a stop id or the model's EOS; the text leaves the stop token
        out, the token count includes it."""
        tok, model = self.target.tokenizer, self.target.model
        stops = list(body["stop_token_ids"]) + [tok.eos_token_id]
        ids = torch.tensor([body["prompt"]])
        sample = body["temperature"] > 0
        with self.lock, torch.no_grad():
            if sample:
                torch.manual_seed(body["seed"])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=body["max_tokens"], eos_token_id=stops,
                                 pad_token_id=stops[0], do_sample=sample,
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

        def do_GET(self):
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
            self._send(200, engine.complete(body))

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF model directory")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    from dflash_lab.target.loader import load_target

    engine = FakeEngine(load_target(args.target, dtype="float32", device="cpu"))
    print(f"serving {args.target} on port {args.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(engine)).serve_forever()


if __name__ == "__main__":
    main()
