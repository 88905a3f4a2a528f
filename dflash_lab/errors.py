"""User errors at the entry points: one line, a non-zero exit, no traceback. Our validation
raises ValueError naming the value, the file and the fix; the entry points run their body inside
:func:`user_errors`, which prints ``error: <message>`` to stderr and exits with status 2.
``DFLASH_DEBUG=1`` or Hydra's ``HYDRA_FULL_ERROR=1`` re-raise instead (the full traceback).
Hydra catches exceptions, not ``SystemExit``, so the exit passes through it.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: Exit status of a refused command line or config (argparse uses 2 as well).
USER_ERROR_EXIT = 2


class UserError(Exception):
    """A refusal that is not a ValueError (e.g. a server unreachable or refusing); its message
    names the value and the fix, so the entry points print it as one line."""


def debugging() -> bool:
    """Whether the user asked for full tracebacks."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("DFLASH_DEBUG",
                                                                 "HYDRA_FULL_ERROR"))


#: errno values of a write the output location cannot take: a full disk (or quota) ...
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: ... and a location that cannot be written (permissions, a read-only mount, a file where a
#: folder should be)
UNWRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR})
#: what a failed write keeps, when the entry point does not say (:func:`user_errors`)
KEPT_DEFAULT = "every file finished before it (a half-written one is removed)"


def output_error(err: BaseException, kept: str = KEPT_DEFAULT) -> UserError | None:
    """A full disk or a location that cannot be written, as one line naming the file, what
    was kept and the fix; None for any other error. A safetensors write's SafetensorError
    carries the errno only in its text (``Os { code: 28, ... }``)."""
    os_err, code = err, re.search(r"Os \{ code: (\d+)", str(err))
    if type(err).__name__ == "SafetensorError" and code:
        os_err = OSError(int(code[1]), os.strerror(int(code[1])))
    if not isinstance(os_err, OSError) or os_err.errno not in DISK_FULL | UNWRITABLE:
        return None
    where = os_err.filename or "an output file"
    if os_err.errno in DISK_FULL:
        return UserError(f"disk full: writing {where} failed ({os_err.strerror}); kept: {kept}. "
                         "Free some space (or choose another output location) and rerun the "
                         "same command")
    return UserError(f"{where}: {os_err.strerror}; choose a location this user can write or "
                     "fix its permissions")


def reported(err: BaseException, kept: str = KEPT_DEFAULT) -> Exception | None:
    """The user error behind ``err``, or None for a bug (its traceback is shown): a ValueError or
    :class:`UserError` (e.g. a ServerError naming the URL and the fix), the ValueError inside
    Hydra's InstantiationException (a ``target.*`` value refused while building the target), or
    a full disk or unwritable location (:func:`output_error`; ``kept``: what the command keeps)."""
    if isinstance(err, (ValueError, UserError)):
        return err
    if (output := output_error(err, kept)) is not None:
        return output
    try:
        from hydra.errors import InstantiationException
    except ImportError:  # the exporter runs without Hydra
        return None
    if isinstance(err, InstantiationException) and isinstance(err.__cause__, ValueError):
        return err.__cause__
    return None


@contextmanager
def user_errors(kept: str = KEPT_DEFAULT) -> Iterator[None]:
    """Turn a user error (:func:`reported`) into ``error: ...`` on stderr and exit 2 (unless
    :func:`debugging`); ``kept``: what a failed write leaves, for a full disk's message."""
    try:
        yield
    except Exception as err:
        user = reported(err, kept)
        if user is None or debugging():
            raise
        print(f"error: {user}\n(DFLASH_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


#: Former command-line / recipe keys -> the one name every command now uses (issue 28).
RENAMED_KEYS = {
    "data.conversations": "data.path (the conversations file, hub id or demo, as in "
                          "dflash-capture and dflash-regenerate)",
    "data.num_samples": "data.limit (the first N conversations after shuffling, as in "
                        "dflash-capture and dflash-regenerate)",
    "capture.num_layers": "capture.target_layer_ids=N (an int N: N evenly spread ids, as "
                          "drafter.target_layer_ids)",
}


def renamed_key_error(key: str, where: str) -> ValueError:
    """The error for a former key ``key`` found in ``where`` (the command line, a recipe)."""
    return ValueError(f"{key} ({where}) is a former name: use {RENAMED_KEYS[key]}")
