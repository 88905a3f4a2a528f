"""vLLM's hidden-states KV connector (``ExampleHiddenStatesConnector``), made to run on a CPU-only
vLLM too: :class:`DflashHiddenStatesConnector` copies synchronously on a CPU cache and is vLLM's
own code on a CUDA cache. Runs inside the vLLM server process (``kv_connector_module_path``) and
imports only vLLM and torch (docs/capture.md, "Capture from a serving engine").
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the CUDA event of a copy that already happened (CPU: copies are synchronous):
    ``synchronize`` returns at once and ``query`` is True."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class DflashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a CPU copy path (see the module docstring)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copy the request's [T, k, H] hidden states out of the cache and queue the file
        write; CUDA caches go through vLLM's own asynchronous path."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.view(1, -1) + blocks.view(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.clone(), "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "two saves of one request id"
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
