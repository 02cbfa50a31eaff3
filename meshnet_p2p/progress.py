"""Progress lines on a terminal, and silence everywhere else (pipes, logs, tests)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class TerminalProgress:
    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self._last = 0.0
        self._phase = ""

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if phase == self._phase and done < total and now - self._last < 0.1:
            return
        self._phase, self._last = phase, now
        pct = 100.0 * done / total if total else 100.0
        bar = "#" * int(pct / 5)
        self.stream.write(f"\r{self.label}: {phase:8s} [{bar:<20s}] {pct:5.1f}% of {total / 1e6:.0f} MB")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
