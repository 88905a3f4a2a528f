"""What dflash-regenerate's :class:`~dflash_lab.serving.completions.CompletionServer` and
dflash-eval's :class:`~dflash_lab.serving.engine.EngineClient` share: the request and the choice
of the served model, with the standard library's ``urllib`` (no client package).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

#: What an unreachable or stalled server raises (an HTTP answer, ``HTTPError``, is caught first).
CONNECTION_ERRORS = (urllib.error.URLError, TimeoutError, ConnectionError)


def json_request(url: str, body: dict[str, Any] | None = None,
                 api_key_env: str | None = None) -> urllib.request.Request:
    """A GET of ``url`` (no ``body``) or a POST of ``body`` as JSON; with ``api_key_env`` (the
    name of an environment variable) its value is sent as the bearer token."""
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(url, data=data, headers=headers)


def pick_served_model(models: list[dict[str, Any]], wanted: str | None, base: str,
                      setting: str, error: type[Exception]) -> dict[str, Any]:
    """The card of ``wanted`` in a ``/models`` answer's ``data`` list (None: the server's only
    model). Raises ``error`` naming ``setting`` (the config key that picks the model) when the
    server serves several and none is picked, or does not serve ``wanted``."""
    ids = [m.get("id") for m in models]
    if wanted is None:
        if len(ids) != 1:
            raise error(f"{base} serves {ids}: set {setting} to one of them")
        wanted = ids[0]
    if wanted not in ids:
        raise error(f"{base} does not serve {setting}={wanted!r}; it serves {ids}")
    return models[ids.index(wanted)]
