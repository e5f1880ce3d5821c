"""A stand-in for torch.cuda.Event that logs each event's record and synchronize, in order (engine/spec_verify_block's
StaleFlags takes its event factory as an argument)."""

from __future__ import annotations

from types import SimpleNamespace


class Events:
    """Call it for a new event; `log` holds ("record" | "wait", event number) in the order they happened."""

    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.made = 0

    def __call__(self):
        self.made += 1
        return SimpleNamespace(record=lambda n=self.made: self.log.append(("record", n)),
                               synchronize=lambda n=self.made: self.log.append(("wait", n)))
