"""Target hidden states from a running vLLM server (``dflash-capture capture.backend=server``),
by vLLM's protocol as speculators 0.9.0's data generator uses it: the ``extract_hidden_states``
method with a hidden-states connector writes ``hidden_states`` [T, k, H] and ``token_ids`` [T] per
prompt. Our id i is vLLM's i + 1, and the server is also asked for the last layer's pre-norm
output (:func:`server_layer_ids`), from which the head-only target derives the labels
(docs/capture.md, "Capture from a serving engine").
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from dflash_lab.serving.completions import CompletionServer, ServerError, all_at_once
from dflash_lab.serving.launch import client_of
from dflash_lab.serving.settings import ServerSettings

CONNECTOR_MODULE = "dflash_lab.serving.vllm_hidden_states_connector"
CONNECTOR_CLASS = "DflashHiddenStatesConnector"
#: The repository root: on the launched server's PYTHONPATH so vLLM imports the connector.
REPO_ROOT = Path(__file__).resolve().parents[2]


def server_layer_ids(target_layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """vLLM aux-layer ids for our z-lab ``target_layer_ids``: each i + 1, plus ``num_hidden_layers``
    (the final hidden state, for the labels); ascending and distinct, as vLLM writes them."""
    return sorted({int(i) + 1 for i in target_layer_ids} | {int(num_hidden_layers)})


def server_args(aux_layer_ids: list[int], storage_dir: str | Path, *,
                connector: str = CONNECTOR_CLASS,
                module: str | None = CONNECTOR_MODULE) -> list[str]:
    """The ``vllm serve`` arguments for hidden states of ``aux_layer_ids`` under ``storage_dir``.
    ``connector="ExampleHiddenStatesConnector", module=None``: vLLM's own (GPU only); default:
    ours (CPU and GPU), which needs this repository on the server's PYTHONPATH."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids]}}}
    kv = {"kv_connector": connector, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if module:
        kv["kv_connector_module_path"] = module
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def _has_extract_args(command: list[str]) -> bool:
    return any(str(a).split("=")[0] in ("--speculative-config", "--speculative_config")
               for a in command)


def read_hidden_states(path: str | Path, *, wait_s: float = 60.0) -> dict[str, torch.Tensor]:
    """The connector's file at ``path``: ``hidden_states`` [T, k, H], ``token_ids`` [T]. Waits
    (shared ``flock`` on ``PATH.lock``, polled up to ``wait_s``) until the writer is done, then
    removes the file and its lock."""
    from safetensors.torch import load_file

    path, lock = Path(path), Path(f"{path}.lock")
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ServerError(f"{path}: the server did not finish writing it "
                                          f"within {wait_s:.0f} s ({lock} stays locked)") from None
                    time.sleep(0.005)
        finally:
            os.close(fd)
    if not path.is_file():
        raise ServerError(f"the server answered with hidden_states_path={str(path)!r}, which "
                          "this machine cannot read: run the capture where the server's "
                          "shared_storage_path is visible (same machine or a shared filesystem)")
    tensors = load_file(str(path))
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return tensors


@dataclass(frozen=True)
class ServedStates:
    """One prompt's answer: ``hidden_states`` [T, k, H] (the server's dtype, k aux layers in
    ascending id order) and the engine's own greedy next token after the prompt."""

    hidden_states: torch.Tensor
    next_token: int | None


class HiddenStatesServer(CompletionServer):
    """Client of a vLLM server started with :func:`server_args` (thread-safe)."""

    def __init__(self, settings: ServerSettings, aux_layer_ids: list[int], hidden_size: int):
        super().__init__(settings)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.hidden_size = int(hidden_size)
        #: [labels checked, labels differing]: the label computed from the served last layer
        #: vs the engine's own greedy token at each prompt's last position (capture_server.py)
        self.argmax_checks = [0, 0]

    def version(self) -> str | None:
        """The engine's version (vLLM: ``GET /version`` at the root), None when it does not say."""
        base, self.base = self.base, self.settings.root
        try:
            return str(self._request("/version").get("version")) or None
        except ServerError:
            return None
        finally:
            self.base = base

    def hidden_states(self, prompt_ids: list[int]) -> ServedStates:
        """The served hidden states of ``prompt_ids`` (one prefill, one greedy token)."""
        body = {"model": self.model, "prompt": [int(t) for t in prompt_ids], "max_tokens": 1,
                "temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                "repetition_penalty": 1.0, "n": 1, "stream": False, "return_token_ids": True}
        answer = self._request("/completions", body)
        params = answer.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path") or params.get("handle")
        if not path:
            raise ServerError(
                f"{self.base}/completions answered without kv_transfer_params."
                f"hidden_states_path ({str(answer)[:300]}): the server was started without the "
                "hidden-states connector. Start vLLM with the arguments "
                f"{server_args(self.aux_layer_ids, '/tmp/dflash_hidden_states')} (and this "
                "repository on its PYTHONPATH), or let the capture start it: server.launch=[...]")
        choice = (answer.get("choices") or [{}])[0]
        tensors = read_hidden_states(path, wait_s=self.settings.timeout_s)
        states, token_ids = tensors["hidden_states"], tensors.get("token_ids")
        want = (len(prompt_ids), len(self.aux_layer_ids), self.hidden_size)  # [T, k, H]
        if tuple(states.shape) != want:
            raise ValueError(
                f"{path}: hidden_states {tuple(states.shape)} but [tokens, layers, hidden] = "
                f"{want} was expected for aux layers {self.aux_layer_ids}: the server extracts "
                "other layers (or serves another model); restart it with "
                f"--speculative-config '{server_args(self.aux_layer_ids, 'DIR')[1]}'")
        if token_ids is not None and token_ids.tolist() != [int(t) for t in prompt_ids]:
            raise ValueError(f"{path}: token_ids differ from the prompt sent; the server "
                             "tokenised it again or mixed requests up")
        generated = choice.get("token_ids") or []
        return ServedStates(states, int(generated[0]) if generated else None)

    def hidden_states_many(self, prompts: list[list[int]]) -> list[ServedStates]:
        """:meth:`hidden_states` of all prompts at once, in order; a failure cancels the rest."""
        return all_at_once([partial(self.hidden_states, p) for p in prompts], "hs")


def open_hidden_states_server(settings: ServerSettings, aux_layer_ids: list[int],
                              hidden_size: int, storage_dir: Path, log_path: Path,
                              world_size: int = 1) -> AbstractContextManager[HiddenStatesServer]:
    """A client of the server at ``settings.url``, or of one started for the block from
    ``settings.launch`` with :func:`server_args` appended (unless the command has its own
    ``--speculative-config``) and this repository on its PYTHONPATH; stopped after."""
    if settings.engine != "vllm":
        raise ValueError(f"server.engine={settings.engine!r}: capture.backend=server speaks "
                         "vLLM's hidden-states connector only (SGLang: unverified, not "
                         "supported); use a vLLM server or capture.backend=local")

    def with_extract_args(command: list[str]) -> list[str]:
        if _has_extract_args(command):
            return command
        storage_dir.mkdir(parents=True, exist_ok=True)
        return command + server_args(aux_layer_ids, storage_dir.absolute())

    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return client_of(settings, log_path,
                     lambda s: HiddenStatesServer(s, aux_layer_ids, hidden_size), world_size,
                     with_extract_args, {"PYTHONPATH": path})
