"""The one description of a served model: the ``server`` group (conf/server/default.yaml) that
dflash-regenerate (``regenerate.backend=server``) and dflash-eval (``backend=server``) compose.
:class:`ServerSettings` holds every key with its one validation (its comments say which client
reads which); :func:`server_settings` builds it, refusing an unknown key by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from dflash_lab.serving.launch import PORT

ENGINES = ("vllm", "sglang")
GROUP_FILE = "conf/server/default.yaml"


@dataclass(frozen=True)
class ServerSettings:
    """Where the server is and how to talk to it (``server.*`` on the command line)."""

    engine: str = "vllm"  # vllm | sglang: how the eval reads acceptance (regeneration: either)
    url: str = "http://localhost:8000/v1"  # the OpenAI-compatible API base (ends in /v1)
    model: str | None = None  # served model id; None: the server's only model
    timeout_s: float = 600.0  # per request
    retries: int = 3  # regeneration: extra attempts after a transient failure (1, 2, 4 s ...)
    api_key_env: str | None = None  # name of an environment variable holding a bearer token
    launch: list[str] | None = None  # start this command ({port} filled) for the run
    start_timeout_s: float = 1800.0  # launch: how long the server may take to be ready
    stream: bool = True  # eval: stream the answer (TTFT and TPOT; else only the total time)
    block_size: int | None = None  # eval: B; None: vLLM's /metrics positions + 1, SGLang's info
    settle_s: float = 2.0  # eval, vLLM: wait at most this long for the counters to stop moving

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"server.engine={self.engine!r} ({GROUP_FILE}): use one of "
                             f"{list(ENGINES)}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server.url={self.url!r} is not an http(s) URL: pass the API base, "
                             "e.g. server.url=http://localhost:8000/v1")
        if self.launch is not None and not any(PORT in str(a) for a in self.launch):
            raise ValueError(f"server.launch={list(self.launch)!r} must contain {PORT} where the "
                             "server takes its port, e.g. [vllm, serve, DIR, --port, '{port}']")
        if self.timeout_s <= 0 or self.start_timeout_s <= 0 or self.settle_s < 0 \
                or self.retries < 0:
            raise ValueError(f"server: timeout_s={self.timeout_s}, start_timeout_s="
                             f"{self.start_timeout_s} must be > 0, settle_s={self.settle_s} "
                             f">= 0, retries={self.retries} >= 0")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"server.block_size={self.block_size}: must be >= 2 (or null)")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"server.api_key_env={self.api_key_env!r}: that environment "
                             "variable is not set")

    @property
    def root(self) -> str:
        """The server's root URL (``/metrics``, SGLang's ``/generate``): url without ``/v1``."""
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base


def server_settings(server_cfg: Any) -> ServerSettings:
    """``server`` group (DictConfig/dict/None) -> :class:`ServerSettings`; unknown keys refused."""
    from omegaconf import DictConfig, OmegaConf

    given = (OmegaConf.to_container(server_cfg, resolve=True) if isinstance(server_cfg, DictConfig)
             else dict(server_cfg or {}))
    known = {f.name for f in fields(ServerSettings)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"server.{unknown[0]} is not a server option ({GROUP_FILE}); the "
                         f"options are {sorted(known)}")
    return ServerSettings(**given)
