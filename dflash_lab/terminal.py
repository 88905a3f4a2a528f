"""What the commands print: each message once, dependencies' noise filtered (:func:`setup`, for
the console entries only; ``DFLASH_DEBUG=1`` shows everything), and the ``dflash-progress
{json}`` lines (:func:`emit`) that ``dflash-lab run`` turns into its live line (docs/pipeline.md).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import sys
import time
import warnings

from tqdm import tqdm

DEBUG_ENV = "DFLASH_DEBUG"
PROGRESS_ENV = "DFLASH_PROGRESS"
PROGRESS_PREFIX = "dflash-progress "
#: Log records from dependencies that tell a user of this toolkit nothing (logger, message start)
NOISE_RECORDS = (("lightning.pytorch.utilities.rank_zero", "\U0001f4a1 Tip:"),)
#: Dependencies' warnings a run always triggers, by message (regex): the frozen target's
#: modules are in eval mode on purpose.
NOISE_WARNINGS = (r"Found \d+ module\(s\) in eval mode",)


def debug() -> bool:
    """``DFLASH_DEBUG=1``: show every message, filter nothing."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def setup() -> None:
    """At a console entry, before the heavy imports: deprecation warnings raised inside
    dependencies (not ones our code triggers: those are attributed to dflash_lab), the
    expected eval-mode notice and Lightning's advertisement are dropped (unless debug())."""
    if debug():
        return
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=category, module=r"dflash_lab\b")
    for pattern in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, start in NOISE_RECORDS:
        logging.getLogger(name).addFilter(
            lambda record, start=start: not str(record.msg).startswith(start))


def one_handler(names: tuple[str, ...] = ("lightning", "lightning.pytorch", "lightning.fabric"),
                ) -> None:
    """Each log line once. Lightning's package loggers get their own console handler at import
    (``lightning`` always) and still pass records up to the root logger's handler (Hydra's):
    imported after Hydra set logging up, every Lightning INFO line printed twice ("INFO: Restoring
    states ..." and "Restoring states ..."). Keep the root's; call after importing Lightning."""
    if not logging.getLogger().handlers:
        return
    for name in names:
        logger = logging.getLogger(name)
        if logger.propagate:
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)


def progress_enabled() -> bool:
    return os.environ.get(PROGRESS_ENV, "") not in ("", "0")


def emit(**fields) -> None:
    """One ``dflash-progress {json}`` line on stderr when :data:`PROGRESS_ENV` is set."""
    if progress_enabled():
        print(PROGRESS_PREFIX + json.dumps(fields), file=sys.stderr, flush=True)


class Bar(tqdm):
    """tqdm that also emits progress lines (at most one a second, and the last)."""

    def display(self, msg=None, pos=None):
        done = super().display(msg, pos)
        now = time.monotonic()
        if now - getattr(self, "_emitted", 0.0) >= 1.0 or self.n == self.total:
            self._emitted = now
            emit(unit=self.unit, done=self.n, total=self.total, what=self.desc or None)
        return done

    def count(self, n: int, tokens: int, name: str) -> None:
        """``update(n)``, with the rate of ``tokens`` (summed over calls) as postfix ``name``."""
        self._tokens = getattr(self, "_tokens", 0) + tokens
        self.update(n)
        self.set_postfix({name: f"{self._tokens / max(self.format_dict['elapsed'], 1e-9):.0f}"})


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class StageOutput:
    """A stage's merged stdout/stderr, fed in chunks: progress lines update :attr:`latest` (and
    :attr:`tau`), the rest goes to ``log`` as lines; a bar redrawn with ``\\r`` is written as its
    state when its line ends and every ``snapshot_s`` seconds, so the log reads line by line."""

    def __init__(self, log, snapshot_s: float = 30.0):
        self.log, self.snapshot_s = log, snapshot_s
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.line, self.latest, self.tau = "", None, None
        self.first: tuple[float, int] | None = None  #: (time, done) of the first progress
        self.snapshot = time.monotonic()

    def feed(self, data: bytes) -> None:
        text = self.decoder.decode(data).replace("\r\n", "\n")
        # runs of plain characters and the single \r / \n between them
        for ch in (piece for piece in re.split(r"([\r\n])", text) if piece):
            if ch == "\n":
                self._end_line()
            elif ch == "\r":
                self._redraw()
            else:
                self.line += ch

    def _redraw(self) -> None:
        if self.line.strip() and time.monotonic() - self.snapshot >= self.snapshot_s:
            self.log.write(self.line + "\n")
            self.snapshot = time.monotonic()
        self.line = ""

    def _end_line(self) -> None:
        at = self.line.find(PROGRESS_PREFIX)
        if at < 0:
            self.log.write(self.line + "\n")
            self.line = ""
            return
        self.read(self.line[at + len(PROGRESS_PREFIX):])
        self.line = self.line[:at]  # a bar's unfinished state before the progress line

    def read(self, payload: str) -> None:
        try:
            fields = json.loads(payload)
        except json.JSONDecodeError:
            return
        if fields.get("tau") is not None:
            self.tau = fields["tau"]
        if fields.get("done") is not None:
            if self.first is None or fields.get("unit") != (self.latest or {}).get("unit"):
                self.first = (time.monotonic(), fields["done"])
            self.latest = fields

    def close(self) -> None:
        self.feed(b"")
        if self.line.strip():
            self.log.write(self.line + "\n")
        self.line = ""

    def status(self, elapsed: float, now: float | None = None) -> str:
        """``step 12/44 · val tau 1.830 · 1:02 elapsed · ~2:50 left`` (the parts known)."""
        parts = []
        p = self.latest
        if p is not None:
            total = p.get("total")
            parts.append(f"{p.get('what') or p.get('unit')} {p['done']}"
                         + (f"/{total}" if total else ""))
        if self.tau is not None:
            parts.append(f"val tau {self.tau:.3f}")
        parts.append(f"{clock(elapsed)} elapsed")
        left = self.remaining(time.monotonic() if now is None else now)
        if left is not None:
            parts.append(f"~{clock(left)} left")
        return " \u00b7 ".join(parts)

    def remaining(self, now: float) -> float | None:
        """Seconds left at the rate since the first progress line of this unit."""
        p = self.latest
        if p is None or not p.get("total") or self.first is None:
            return None
        t0, done0 = self.first
        if p["done"] <= done0 or now <= t0:
            return None
        return (now - t0) * (p["total"] - p["done"]) / (p["done"] - done0)
