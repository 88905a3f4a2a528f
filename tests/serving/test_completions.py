"""dflash-regenerate through a server (regenerate.backend=server): a local stand-in for vLLM's
OpenAI-compatible /v1/completions runs the tiny target one request at a time; the server
backend must give exactly the conversations the in-process backend gives, send token ids with
explicit sampling fields and the target's stops, retry transient failures and explain the rest.
The real engine is checked by `make check-serving` (scripts/check_serving.py)."""

import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import dflash_lab.serving.completions as cs
from dflash_lab.data.regenerate_loop import (
    MERGED_FILE,
    RegenerateSettings,
    decode_reply,
    run_regenerate,
)
from dflash_lab.paths import CONF_DIR
from dflash_lab.serving.completions import CompletionServer, ServerError
from dflash_lab.serving.settings import ServerSettings
from dflash_lab.targets.chat import render_prompt, target_stop_ids
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.fake_openai_server import MODEL_ID, SCRIPT, FakeEngine, handler


@pytest.fixture
def served(tiny_target):
    """(engine, url) of a stand-in server on a free local port."""
    engine = FakeEngine(tiny_target)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler(engine))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield engine, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _data(n, seed=5):
    return [{"messages": c} for c in demo_conversations(n, seed=seed)]


def _server(url, **kw):
    return CompletionServer(ServerSettings(url=url, **kw))


def test_server_backend_gives_exactly_the_in_process_conversations(tiny_target, served,
                                                                   tmp_path):
    engine, url = served
    data, kw = _data(9), dict(max_new_tokens=24, part_size=4, batch_size=3)
    here = run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "hf"), **kw),
                          {"path": "demo"}, progress=False)
    there = run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "srv"), **kw),
                           {"path": "demo"}, progress=False, server=_server(url))
    assert _rows(tmp_path / "srv" / MERGED_FILE) == _rows(tmp_path / "hf" / MERGED_FILE)
    assert there["num_conversations"] == here["num_conversations"] == 9
    assert there["server"] == {"model": MODEL_ID}
    assert "server" not in here  # in-process outputs keep the settings record they always had
    assert len(engine.requests) > 9  # one request per assistant turn


def test_requests_carry_token_ids_explicit_sampling_fields_and_the_targets_stops(
        tiny_target, served, tmp_path):
    engine, url = served
    conv = demo_conversations(1, seed=2)[0]
    s = RegenerateSettings(str(tmp_path / "g"), max_new_tokens=16)
    run_regenerate(tiny_target, [{"messages": conv}], s, {"path": "demo"}, progress=False,
                   server=_server(url))
    first = engine.requests[0]
    tok = tiny_target.tokenizer
    first_reply = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
    want_ids = tok(render_prompt(tok, conv[:first_reply]), add_special_tokens=False)["input_ids"]
    assert first["prompt"] == want_ids  # token ids: no server-side template, no second BOS
    assert first["model"] == MODEL_ID and first["max_tokens"] == 16
    assert first["stop_token_ids"] == target_stop_ids(tiny_target)
    # Nothing left for the engine to fill from the model's generation_config.json.
    assert (first["temperature"], first["top_p"], first["top_k"], first["min_p"],
            first["repetition_penalty"]) == (0.0, 1.0, -1, 0.0, 1.0)
    assert "seed" not in first and first["return_token_ids"] is True


def test_a_server_without_token_ids_falls_back_to_its_text(tiny_target, served, tmp_path):
    engine, url = served
    engine.returns_token_ids = False
    data, kw = _data(5, seed=8), dict(max_new_tokens=24, part_size=5, batch_size=5)
    run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "hf"), **kw),
                   {"path": "demo"}, progress=False)
    run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / "srv"), **kw),
                   {"path": "demo"}, progress=False, server=_server(url))
    assert _rows(tmp_path / "srv" / MERGED_FILE) == _rows(tmp_path / "hf" / MERGED_FILE)


def test_a_reply_cut_inside_a_character_drops_the_partial_character(tiny_target):
    tok, stops = tiny_target.tokenizer, target_stop_ids(tiny_target)
    ids = tok("héllo 日本", add_special_tokens=False)["input_ids"]  # byte-level: 日 is 3 tokens
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert decode_reply(tok, ids[:cut], stops) == (tok.decode(ids[:cut]).rstrip("\ufffd"), cut)
    assert "\ufffd" not in decode_reply(tok, ids[:cut], stops)[0]
    assert decode_reply(tok, ids, stops) == ("héllo 日本", len(ids))
    assert decode_reply(tok, [*ids, stops[0], 5, 6], stops) == ("héllo 日本", len(ids) + 1)


def test_sampling_through_the_server_is_seeded_per_part(tiny_target, served, tmp_path):
    engine, url = served
    data, kw = _data(4, seed=6), dict(max_new_tokens=24, part_size=2, temperature=1.0, seed=3)
    outs = []
    for name in ("a", "b"):
        run_regenerate(tiny_target, data, RegenerateSettings(str(tmp_path / name), **kw),
                       {"path": "demo"}, progress=False, server=_server(url))
        outs.append(_rows(tmp_path / name / MERGED_FILE))
    assert outs[0] == outs[1]
    seeds = [r["seed"] for r in engine.requests]
    assert len(set(seeds)) == len(seeds) // 2  # fresh per request, repeated by the rerun
    greedy = tmp_path / "g"
    run_regenerate(tiny_target, data, RegenerateSettings(str(greedy), max_new_tokens=24,
                                                         part_size=2), {"path": "demo"},
                   progress=False, server=_server(url))
    assert _rows(greedy / MERGED_FILE) != outs[0]  # sampling really sampled


def test_transient_failures_are_retried(tiny_target, served, tmp_path, monkeypatch):
    engine, url = served
    monkeypatch.setattr(cs.time, "sleep", lambda s: None)
    engine.fail_next = [(503, "warming up"), (502, "bad gateway")]
    data = _data(2)
    s = RegenerateSettings(str(tmp_path / "r"), max_new_tokens=16, batch_size=1)
    out = run_regenerate(tiny_target, data, s, {"path": "demo"}, progress=False,
                         server=_server(url, retries=2))
    assert out["num_conversations"] == 2
    with pytest.raises(ServerError, match=r"failed 3 times .*HTTP 503.*rerun the same command"):
        engine.fail_next = [(503, "down")] * 3
        _server(url, retries=2, model=MODEL_ID).complete(
            [1, 2], max_tokens=4, temperature=0.0, top_p=1.0, stop_token_ids=[0], seed=None)


def test_a_rejected_request_raises_with_the_servers_message(served):
    engine, url = served
    engine.fail_next = [(400, "This model's maximum context length is 512 tokens")]
    with pytest.raises(ServerError, match="HTTP 400.*maximum context length is 512"):
        _server(url, model=MODEL_ID).complete([1, 2], max_tokens=4, temperature=0.0,
                                              top_p=1.0, stop_token_ids=[0], seed=None)
    assert len(engine.requests) == 1  # a 4xx is not retried
    engine.fail_next = [(404, "Not Found")]  # e.g. server.url without /v1, or another server
    with pytest.raises(ServerError, match=r"HTTP 404\) \(no such path: is server.url the "
                                          r"OpenAI-compatible API base.*ending in /v1"):
        _server(url, model=MODEL_ID).complete([1, 2], max_tokens=4, temperature=0.0,
                                              top_p=1.0, stop_token_ids=[0], seed=None)


def test_a_failure_surfaces_without_waiting_for_slow_requests(served):
    engine, url = served
    engine.delay_s = 5.0
    engine.reject = {(9, 9): (400, "bad request")}  # the LAST prompt fails at once
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="bad request"):
        _server(url, model=MODEL_ID, retries=0).complete_many(
            [[1, 2]] * 3 + [[9, 9]], [None] * 4, max_tokens=4, temperature=0.0, top_p=1.0,
            stop_token_ids=[0])
    assert time.monotonic() - t0 < 4.0  # not after the 5 s answers of the first three


def test_an_unreachable_server_says_how_to_start_one(monkeypatch):
    from dflash_lab.serving.launch import free_port

    monkeypatch.setattr(cs.time, "sleep", lambda s: None)
    port = free_port()  # a port nobody listens on
    with pytest.raises(ServerError, match=r"vllm serve TARGET_DIR.*server.url"):
        _server(f"http://127.0.0.1:{port}/v1", retries=1).connect(max_length=64)


def test_model_choice_and_context_length_are_checked_before_any_generation(tiny_target,
                                                                           served, tmp_path):
    engine, url = served
    engine.max_model_len = 512
    s = RegenerateSettings(str(tmp_path / "x"), max_new_tokens=16, max_length=1024)
    with pytest.raises(ValueError, match="max_length=1024 exceeds the server's max_model_len=512"):
        run_regenerate(tiny_target, _data(1), s, {"path": "demo"}, progress=False,
                       server=_server(url))
    engine.models = [MODEL_ID, "other"]
    with pytest.raises(ServerError, match="serves .*'other'.*set server.model"):
        _server(url).connect(max_length=64)
    with pytest.raises(ServerError, match="does not serve server.model='nope'"):
        _server(url, model="nope").connect(max_length=64)
    assert _server(url, model="other").connect(max_length=64)["model"] == "other"
    assert engine.requests == [] and not (tmp_path / "x").exists()


def test_a_resume_must_keep_the_backend(tiny_target, served, tmp_path):
    _, url = served
    s = RegenerateSettings(str(tmp_path / "o"), max_new_tokens=8, part_size=1)
    run_regenerate(tiny_target, _data(1), s, {"path": "demo"}, progress=False)
    with pytest.raises(ValueError, match="other settings.*'server'"):
        run_regenerate(tiny_target, _data(1), s, {"path": "demo"}, progress=False,
                       server=_server(url))


def test_bad_server_settings_name_the_key(monkeypatch):
    with pytest.raises(ValueError, match="server.url='localhost:8000'"):
        ServerSettings(url="localhost:8000")
    with pytest.raises(ValueError, match="retries=-1"):
        ServerSettings(retries=-1)
    monkeypatch.delenv("DFLASH_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="'DFLASH_TEST_KEY'.*not set"):
        ServerSettings(api_key_env="DFLASH_TEST_KEY")


def _compose(tmp_path, *overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="regenerate", overrides=[
            "data.demo_rows=3", f"data.demo_file={tmp_path / 'demo.jsonl'}",
            "regenerate.progress=false", f"regenerate.settings.out_dir={tmp_path / 'out'}",
            "regenerate.settings.max_new_tokens=16", *overrides])


def test_cli_backend_server_loads_the_target_head_only(tiny_target_dir, served, tmp_path):
    from dflash_lab.regenerate import regenerate

    _, url = served
    cfg = _compose(tmp_path, "target=hf", f"target.name_or_path={tiny_target_dir}",
                   "target.dtype=float32", "target.device=cpu", "regenerate.backend=server",
                   f"server.url={url}")
    manifest = regenerate(cfg)
    assert cfg.target.head_only is True  # weights of the decoder layers were never read
    assert manifest["num_conversations"] == 3 and manifest["server"]["model"] == MODEL_ID
    with pytest.raises(ValueError, match="regenerate.backend='vllm'.*use hf .* or server"):
        regenerate(_compose(tmp_path, "regenerate.backend=vllm"))


def test_cli_launches_the_server_for_the_run_and_stops_it(tiny_target_dir, tmp_path):
    import socket
    import sys

    from dflash_lab.regenerate import regenerate

    cfg = _compose(tmp_path, "target=hf", f"target.name_or_path={tiny_target_dir}",
                   "target.dtype=float32", "target.device=cpu", "regenerate.backend=server",
                   f"server.launch=[{sys.executable},{SCRIPT},--target,"
                   f"{tiny_target_dir},--port,'{{port}}']", "server.start_timeout_s=120")
    manifest = regenerate(cfg)
    assert manifest["num_conversations"] == 3 and manifest["server"]["model"] == MODEL_ID
    log = (tmp_path / "out" / "server.log").read_text()
    port = int(log.split("on port ")[1].split()[0])
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", port))  # stopped when the run ended


def test_a_launched_server_that_dies_shows_its_log(tmp_path):
    import sys

    from dflash_lab.serving.completions import open_server

    settings = ServerSettings(launch=[sys.executable, "-c",
                                      "import sys; print('no model at port {port}'); sys.exit(3)"])
    with (pytest.raises(RuntimeError, match=r"exited \(3\)(.|\n)*no model at port"),
          open_server(settings, tmp_path / "server.log")):
        pass
    with (pytest.raises(ValueError, match="WORLD_SIZE=2 start the server yourself"),
          open_server(settings, tmp_path / "server.log", world_size=2)):
        pass
    with pytest.raises(ValueError, match=r"must contain \{port\}"):
        ServerSettings(launch=["vllm", "serve", "/models/x"])
    missing = ServerSettings(launch=["no-such-vllm-program", "serve", "--port", "{port}"])
    with (pytest.raises(ValueError, match=r"server.launch: could not start "
                                          r"'no-such-vllm-program' \(No such file or directory\)"
                                          r".*Fix: the first item must be a program on PATH"),
          open_server(missing, tmp_path / "server.log")):
        pass
