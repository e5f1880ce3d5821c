"""Recording the aten ops a piece of code dispatches: how the engine tests show an op is gone."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """Every aten op dispatched while active, by name (interpreted Triton kernels run with it suspended)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
