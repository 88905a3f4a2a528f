"""dflash-eval backend=server (dflash_lab/serving/engine.py) against tests/fake_openai_server.py:
the prompts go as the local eval's token ids; vLLM's acceptance is the per-request delta of its
/metrics counters (vLLM 0.32's exact Prometheus text), SGLang's the meta_info of /generate;
both tau conventions, TTFT/TPOT, and the errors (server down, no speculative decoding).
The real engine is checked by `make check-serving` (scripts/check_serving.py, stage server-eval).
"""

import json
import sys
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dflash_lab.eval import cli
from dflash_lab.eval.suite import load_items, prompt_ids
from dflash_lab.paths import CONF_DIR
from dflash_lab.serving.engine import (
    EngineClient,
    EngineError,
    Sampling,
    histogram_from_positions,
    parse_vllm_metrics,
)
from dflash_lab.serving.launch import free_port
from dflash_lab.serving.settings import ServerSettings
from dflash_lab.targets.chat import target_stop_ids
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.fake_openai_server import MODEL_ID, SCRIPT, FakeEngine, FakeSpec, handler

#: prometheus_client's text for vLLM's counters (generated in .venv-vllm with vLLM 0.32's names,
#: label names and documentation), two engines, created samples and an unrelated family included.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 3.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 2.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.796156678254287e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 21.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="tiny"} 14.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 9.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 1.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="1"} 0.0
"""

PATTERN = [3, 0, 7, 2, 5]  # drafts accepted per round in the fake engine (B = 8)


def _serve(engine):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler(engine))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/v1"


@pytest.fixture
def spec_engine(tiny_target):
    """(engine, url): a speculative fake, its counters already moved by earlier traffic."""
    spec = FakeSpec(8, PATTERN, {"drafts": 40, "draft_tokens": 280, "accepted": 90},
                    [30, 20, 15, 10, 8, 4, 3])
    engine = FakeEngine(tiny_target, spec=spec)
    httpd, url = _serve(engine)
    yield engine, url
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n"
                            for c in demo_conversations(3, seed=21)))
    return path


def _greedy(target, ids, max_new, stops):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = target.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                    max_new_tokens=max_new, eos_token_id=list(stops),
                                    pad_token_id=stops[0], do_sample=False)[0, len(ids):]
    out = out.tolist()
    end = next((i for i, t in enumerate(out) if t in stops), None)
    return out[:end + 1] if end is not None else out


def _run_cli(monkeypatch, tiny_target_dir, prompts_file, out, *extra):
    argv = ["dflash-eval", "backend=server", "target=hf", f"target.name_or_path={tiny_target_dir}",
            f"data.path={prompts_file}", f"output_dir={out}", "num_prompts=3",
            "max_new_tokens=24", "target.device=cpu", "progress=false", *extra]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    return json.loads((out / "report.json").read_text())


# ------------------------------------------------------------------ vLLM /metrics
def _local_prompt_ids(tokenizer, path, num: int) -> list[list[int]]:
    """The first ``num`` prompts of a file as the local eval renders them (chat template)."""
    d = OmegaConf.create({"path": str(path), "chat_template": True})
    return [prompt_ids(tokenizer, item.messages, d, {}) for item in load_items(d, num)]


def test_vllm_metrics_text_is_parsed_and_summed_over_engines():
    c = parse_vllm_metrics(VLLM_METRICS, "http://h/metrics")
    assert (c.drafts, c.draft_tokens, c.accepted, c.per_pos) == (5, 35, 10, [4, 2])


def test_histogram_from_per_position_counts():
    # 5 rounds: per_pos[t] = rounds accepting draft t -> exactly 0, 1, 2 accepted: 1, 2, 2
    assert histogram_from_positions(5, [4, 2]) == [1, 2, 2]


def test_missing_spec_counters_say_the_server_runs_without_speculation(tiny_target):
    engine = FakeEngine(tiny_target)  # serves /metrics, but no spec_decode family
    httpd, url = _serve(engine)
    try:
        with pytest.raises(EngineError, match="not started with speculative decoding") as err:
            EngineClient(ServerSettings(url=url)).connect()
        assert url.removesuffix("/v1") + "/metrics" in str(err.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_down_names_the_url():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EngineError, match="could not reach") as err:
        EngineClient(ServerSettings(url=url)).connect()
    assert f"{url}/models" in str(err.value) and "server.url" in str(err.value)


def test_settings_refuse_unknown_engine_and_bad_url():
    with pytest.raises(ValueError, match="server.engine='tgi'"):
        ServerSettings(engine="tgi")
    with pytest.raises(ValueError, match="server.url='localhost:8000'"):
        ServerSettings(url="localhost:8000")
    with pytest.raises(ValueError, match=r"\{port\}"):
        ServerSettings(launch=["vllm", "serve", "/m"])


# ------------------------------------------------------------------ the command line, vLLM
def test_cli_vllm_backend_measures_the_engines_rounds(tiny_target, tiny_target_dir, spec_engine,
                                                     prompts_file, tmp_path, monkeypatch):
    engine, url = spec_engine
    report = _run_cli(monkeypatch, tiny_target_dir, prompts_file, tmp_path / "out",
                      f"server.url={url}")
    prompts = _local_prompt_ids(tiny_target.tokenizer, prompts_file, 3)
    stops = tuple(target_stop_ids(tiny_target))
    measured = engine.requests[1:]  # the first is the untimed warm-up (8 tokens)
    assert engine.requests[0]["max_tokens"] == 8
    assert [r["prompt"] for r in measured] == prompts  # token ids, as local
    assert all(r["stop_token_ids"] == list(stops) and r["temperature"] == 0.0
               and r["top_k"] == -1 and r["stream"] for r in measured)
    assert report["outputs"] == [_greedy(tiny_target, p, 24, stops) for p in prompts]
    assert report["settings"]["block_size"] == 8  # 7 per-position counters + 1
    spec = FakeSpec(8, PATTERN)
    for rec, eng, out in zip(report["records"], report["engine_responses"], report["outputs"]):
        rounds = spec.rounds(len(out))  # this response's rounds, not the counters' totals
        assert rec["num_rounds"] == eng["rounds"] == len(rounds)
        assert rec["num_round_tokens"] == len(out) - 1 == sum(kept for _, kept in rounds)
        assert eng["engine_tau"] == pytest.approx(1 + sum(a for a, _ in rounds) / len(rounds))
        assert rec["ttft_s"] is not None and rec["tpot_s"] is not None
    taus = [r["num_round_tokens"] / r["num_rounds"] for r in report["records"]]
    assert report["tau_macro"] == pytest.approx(sum(taus) / 3)
    assert report["tau_mean"] == report["tau_pooled"] == pytest.approx(
        sum(r["num_round_tokens"] for r in report["records"]) / report["num_rounds"])
    assert sum(report["acceptance_histogram"]) == report["num_rounds"]
    assert (tmp_path / "out" / "report.md").is_file()


def test_sampled_requests_carry_seed_plus_index(tiny_target, tiny_target_dir, spec_engine,
                                                prompts_file, tmp_path, monkeypatch):
    """T > 0: seed + i per prompt. A head-only target (tokenizer and generation config, no
    layers) gives the same prompt and stop ids as the full one."""
    engine, url = spec_engine
    report = _run_cli(monkeypatch, tiny_target_dir, prompts_file, tmp_path / "out",
                      f"server.url={url}", "temperature=0.7", "seed=11", "warmup=false",
                      "target.head_only=true")
    assert [(r["temperature"], r["seed"]) for r in engine.requests] == [(0.7, 11), (0.7, 12),
                                                                       (0.7, 13)]
    assert report["settings"]["sampling"] == "engine"
    assert report["prompt_ids"] == _local_prompt_ids(tiny_target.tokenizer, prompts_file, 3)
    assert report["settings"]["stop_token_ids"] == target_stop_ids(tiny_target)


def test_block_size_follows_vllms_convention(spec_engine):
    """vLLM's num_speculative_tokens is B - 1: its 7 per-position counters mean B = 8."""
    _, url = spec_engine
    assert EngineClient(ServerSettings(url=url, block_size=8)).connect()["block_size"] == 8
    with pytest.raises(EngineError, match="server.block_size=7 but .* B=8"):
        EngineClient(ServerSettings(url=url, block_size=7)).connect()


def test_non_streaming_has_no_ttft(spec_engine, tiny_target):
    engine, url = spec_engine
    client = EngineClient(ServerSettings(url=url, stream=False))
    client.connect()
    resp = client.generate([1, 2, 3], Sampling(12, 0.0, (), ignore_eos=True))
    assert resp.num_output_tokens == 12 and resp.rounds == len(FakeSpec(8, PATTERN).rounds(12))
    assert resp.ttft_s is None and resp.tpot_s is None
    assert engine.requests[-1]["ignore_eos"] is True


# ------------------------------------------------------------------ SGLang
@pytest.mark.parametrize("stream,cumulative", [(True, False), (True, True), (False, False)])
def test_sglang_meta_info(tiny_target, spec_engine, stream, cumulative):
    engine, url = spec_engine
    engine.sglang_cumulative_ids = cumulative
    client = EngineClient(ServerSettings(engine="sglang", url=url, stream=stream))
    assert client.connect()["block_size"] == 8  # /get_server_info speculative_num_draft_tokens
    resp = client.generate([5, 6, 7], Sampling(10, 0.0, (), ignore_eos=True))
    rounds = FakeSpec(8, PATTERN).rounds(10)
    assert resp.rounds == len(rounds) and resp.engine_tau == pytest.approx(10 / len(rounds))
    assert resp.tau == pytest.approx(9 / len(rounds))
    assert resp.output_ids == _greedy(tiny_target, [5, 6, 7], 10, [-1])
    assert (resp.ttft_s is not None) == stream
    body = engine.requests[-1]
    assert body["input_ids"] == [5, 6, 7] and body["sampling_params"]["max_new_tokens"] == 10


def test_sglang_without_speculation_is_refused(tiny_target):
    httpd, url = _serve(FakeEngine(tiny_target))
    try:
        client = EngineClient(ServerSettings(engine="sglang", url=url, block_size=8))
        client.connect()
        with pytest.raises(EngineError, match="spec_verify_ct: the server was not started"):
            client.generate([5, 6], Sampling(4, 0.0, ()))
    finally:
        httpd.shutdown()
        httpd.server_close()


# ------------------------------------------------------------------ config
def test_backend_config_is_checked_at_start_up(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        bad = compose("eval", overrides=["backend=engine", f"output_dir={tmp_path}"])
        features = compose("eval", overrides=["backend=server", "mode=features",
                                              f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="backend='engine'"):
        cli.check_config(bad)
    with pytest.raises(ValueError, match="backend=server measures generation"):
        cli.check_config(features)


def test_cli_launches_the_server_for_the_run(tiny_target_dir, prompts_file, tmp_path,
                                             monkeypatch):
    launch = (f"server.launch=[{sys.executable},{SCRIPT},--target,{tiny_target_dir},--port,"
              "'{port}',--spec-pattern,'2,6']")
    report = _run_cli(monkeypatch, tiny_target_dir, prompts_file, tmp_path / "out", launch,
                      "warmup=false")
    assert report["settings"]["served_model"] == MODEL_ID
    assert report["num_rounds"] > 0 and (tmp_path / "out" / "server.log").is_file()


def test_mt_bench_turn_two_follows_the_engines_answer(tiny_target, tiny_target_dir, spec_engine,
                                                      tmp_path, monkeypatch):
    """A reference dataset through the engine: data=mt-bench from a local copy, two responses
    per row, turn 2's prompt holds the engine's turn-1 answer; one report row per dataset."""
    engine, url = spec_engine
    rows = tmp_path / "mt.jsonl"
    rows.write_text(json.dumps({"prompt": ["say hi", "now bye"], "prompt_id": 1}) + "\n")
    report = _run_cli(monkeypatch, tiny_target_dir, rows, tmp_path / "out", f"server.url={url}",
                      "data=mt-bench", "num_prompts=1", "warmup=false")
    assert [(r["dataset"], r["turn"]) for r in report["records"]] == [("mt-bench", 0),
                                                                      ("mt-bench", 1)]
    answer = tiny_target.tokenizer.decode(report["outputs"][0], skip_special_tokens=True)
    tok = tiny_target.tokenizer
    turn2 = tok.decode(engine.requests[1]["prompt"])
    assert answer in turn2 and "now bye" in turn2 and "say hi" in turn2
    assert report["prompt_ids"][1] == engine.requests[1]["prompt"]
    assert report["datasets"]["mt-bench"]["num_responses"] == 2
    assert report["datasets"]["mt-bench"]["acceptance_histogram_from_engine"] is True
