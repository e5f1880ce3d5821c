"""What the prepare steps print: one line per message, one line per 10% of a long loop."""

from __future__ import annotations

import time


def say(message: str) -> None:
    print(message, flush=True)


class Progress:
    """One line per 10% of a long loop (plain lines: readable in logs and in a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.next = label, total, 0.1
        self.start = time.monotonic()

    def update(self, done: int) -> None:
        if self.total and done / self.total + 1e-9 >= self.next:
            say(f"  {self.label}: {100 * done // self.total}% ({time.monotonic() - self.start:.1f} s)")
            while self.next <= done / self.total + 1e-9:
                self.next += 0.1
