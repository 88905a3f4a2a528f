"""Shared fixtures: the built-in tiny target, materialised once and cached across sessions."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_target_dir(request) -> Path:
    """Directory of the built-in tiny target (HF layout). Cached in pytest's cache dir, rebuilt
    only when the tiny-target recipe changes (marker check), so most sessions reuse it."""
    from dflash_lab.targets.tiny import materialize_tiny_target

    return materialize_tiny_target(Path(request.config.cache.mkdir("dflash_tiny_target")) / "t")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    """The tiny target loaded in float32 on CPU (frozen). Do not modify it in tests."""
    from dflash_lab.targets.loader import load_target

    return load_target(str(tiny_target_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny tensors run much faster single-threaded (and stay stable on a loaded 2-core box)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def wandb_offline():
    """Tests never reach the network. (wandb also keeps process-global state: after a
    ``mode=disabled`` run, a later offline run in the same process asks for a login unless the
    mode is set in the environment.)"""
    import os

    old = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"
    yield
    if old is None:
        os.environ.pop("WANDB_MODE", None)
    else:
        os.environ["WANDB_MODE"] = old


@pytest.fixture
def offline_hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache used offline, in this process and in subprocesses (the env vars):
    publish models into it with ``stand_ins.publish_to_hf_cache(src, repo_id, cache)``."""
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hf_hub_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache


#: z-lab layer ids the stand-in hidden-states server serves on the 8-layer tiny target: vLLM aux
#: ids [2, 5, 7] plus 8 (the last layer's output, for the labels)
HIDDEN_STATES_LAYERS = [1, 4, 6]


@pytest.fixture
def hidden_states_server(tiny_target, tmp_path):
    """(engine, url) of a stand-in vLLM with the hidden-states connector for
    HIDDEN_STATES_LAYERS (tests/fake_openai_server.py), on a free local port."""
    import threading
    from http.server import ThreadingHTTPServer

    from dflash_lab.serving.hidden_states import server_layer_ids
    from tests.fake_openai_server import FakeEngine, handler

    engine = FakeEngine(tiny_target)
    engine.hidden_states = (server_layer_ids(HIDDEN_STATES_LAYERS, 8), tmp_path / "store")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler(engine))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield engine, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()
