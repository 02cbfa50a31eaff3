"""Progress of long operations (hashing, cutting, loading a shard, certifying):
a bar redrawn in place on a terminal, plain lines anywhere else (a pipe, a
log file, a service manager's journal): one when a phase ends, saying how long
it took, and one every PLAIN_EVERY_S while it lasts, so a log says what
happened without filling up with carriage returns."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import TextIO

PLAIN_EVERY_S = 10.0  # off a terminal, a line when a phase ends, and one this often while it lasts


class TerminalProgress:
    """A progress callback ``(phase, done, total)``; ``total`` in bytes (shown in
    MB) or, for small totals such as a load's thousandths, shown as a percentage."""

    def __init__(self, label: str, stream: TextIO | None = None, *, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = _isatty(self.stream)
        self.label = label
        self.clock = clock
        self._last = 0.0
        self._phase = ""
        self._started = 0.0
        self._ended = ""  # the phase whose end was shown (callers may report the end twice)

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        new_phase = phase != self._phase
        if new_phase:
            self._phase, self._started = phase, now
        finished = done >= total
        if finished and self._ended == phase and not new_phase:
            return
        if not finished and self._ended == phase:  # the same phase again (a second shard's load): a new run
            self._ended, self._started, new_phase = "", now, True
        if finished:
            self._ended = phase
        if self.tty:
            if not new_phase and not finished and now - self._last < 0.1:
                return
            self._last = now
            pct = 100.0 * done / total if total else 100.0
            bar = "#" * int(pct / 5)
            self.stream.write(f"\r{self.label}: {phase:8s} [{bar:<20s}] {pct:5.1f}%{_size(total)}")
            if finished:
                self.stream.write("\n")
        else:
            if new_phase:
                self._last = now  # a short phase says only that it ended, and how long it took
            if not (finished or now - self._last >= PLAIN_EVERY_S):
                return
            self._last = now
            pct = 100.0 * done / total if total else 100.0
            took = f" in {now - self._started:.1f} s" if finished else ""
            self.stream.write(f"{self.label}: {phase} {pct:.0f}%{_size(total)}{took}\n")
        self.stream.flush()


def _size(total: int) -> str:
    return f" of {total / 1e6:.0f} MB" if total >= 100_000 else ""


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class StatusLine:
    """One line kept at the bottom of a terminal and redrawn in place (``join``'s
    sessions, tokens/s and peers), with other output printed above it. Off a
    terminal it is silent: logs get the ordinary lines only. Threads print
    through it (a data plane's handlers say when a session opens), so each
    write is whole under a lock; a terminal that went away turns it off."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = _isatty(self.stream)
        self.text = ""
        self._lock = threading.Lock()

    def _write(self, data: str) -> None:
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal closed: the peer serves on, quietly
            self.enabled = False

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        width = shutil.get_terminal_size((120, 24)).columns
        with self._lock:
            self.text = text[: max(10, width - 1)]  # one line: a wrapped one would leave stale copies above
            self._write("\r\x1b[K" + self.text)

    def close(self) -> None:
        """Clear the line, so what is printed next (an error, the shell's prompt) starts clean."""
        if self.enabled:
            with self._lock:
                self._write("\r\x1b[K")
                self.text = ""

    def wrap(self, print_line):
        """``print_line``, clearing the status line first and redrawing it after."""
        if not self.enabled:
            return print_line

        def printed(line: str) -> None:
            with self._lock:
                if not self.enabled:
                    print_line(line)
                    return
                self._write("\r\x1b[K")
                print_line(line)
                if self.text:
                    self._write(self.text)
        return printed
