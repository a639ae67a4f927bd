"""A plain-stderr progress line: redrawn in place on a terminal, printed every few
seconds otherwise (CI logs), silent when disabled."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class ProgressBar:
    total: int
    enabled: bool = True
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    width: int = 28
    log_every_s: float = 10.0
    _last_log: float = 0.0

    def render(self, done: int, errors: int, out_tokens: int, elapsed: float) -> str:
        fraction = min(1.0, done / self.total) if self.total else 1.0
        filled = int(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        rate = out_tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"[{bar}] {done}/{self.total} req  {elapsed:6.1f}s  "
            f"{rate:7.1f} out tok/s  errors {errors}"
        )

    def update(self, done: int, errors: int, out_tokens: int, elapsed: float) -> None:
        if not self.enabled:
            return
        line = self.render(done, errors, out_tokens, elapsed)
        if self.stream.isatty():
            self.stream.write("\r" + line)
            self.stream.flush()
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self, done: int, errors: int, out_tokens: int, elapsed: float) -> None:
        if not self.enabled:
            return
        line = self.render(done, errors, out_tokens, elapsed)
        self.stream.write(("\r" + line if self.stream.isatty() else line) + "\n")
        self.stream.flush()
