"""User errors at the entry points: one line, a non-zero exit, no traceback.

Our validation raises ValueError naming the value, the file and the fix; the entry points run
their body inside :func:`user_errors`, which prints ``error: <message>`` to stderr and exits
with status 2. ``DFLASH_DEBUG=1`` or Hydra's ``HYDRA_FULL_ERROR=1`` re-raise instead (the full
traceback). Hydra catches exceptions, not ``SystemExit``, so the exit passes through it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: Exit status of a refused command line or config (argparse uses 2 as well).
USER_ERROR_EXIT = 2


def debugging() -> bool:
    """Whether the user asked for full tracebacks."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("DFLASH_DEBUG",
                                                                 "HYDRA_FULL_ERROR"))


def reported(err: BaseException) -> Exception | None:
    """The user error behind ``err``: a ValueError itself, a ServerError (a server unreachable
    or refusing: its message names the URL and the fix), or the ValueError Hydra's
    ``instantiate`` wrapped in an InstantiationException (a ``target.*`` value refused while
    the target is built); None for anything else (a bug: its traceback is shown)."""
    from dflash_lab.serving.completions import ServerError

    if isinstance(err, (ValueError, ServerError)):
        return err
    try:
        from hydra.errors import InstantiationException
    except ImportError:  # the exporter runs without Hydra
        return None
    if isinstance(err, InstantiationException) and isinstance(err.__cause__, ValueError):
        return err.__cause__
    return None


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user error (:func:`reported`) into ``error: ...`` on stderr and exit 2 (unless
    :func:`debugging`)."""
    try:
        yield
    except Exception as err:
        user = reported(err)
        if user is None or debugging():
            raise
        print(f"error: {user}\n(DFLASH_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
