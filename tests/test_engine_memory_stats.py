"""qwen_serving.engine.worker_memory_stats (worker-memory-stats.patch): the GPU Worker's qs_memory_stats, on the
CPU with torch.cuda's allocator functions stubbed by a fake allocator (its figures in bytes, its peaks resettable).

The hook's own logic (keys, bytes, the peaks read before a reset, the reset only when asked, the string argument),
then the patched Worker's method reached as vLLM's dev API reaches it: the /collective_rpc route of
vllm/entrypoints/serve/dev/rpc/api_router.py, an engine client that runs the method through vLLM's run_method on a
WorkerWrapperBase (whose __getattr__ hands it to the Worker), and the JSON that comes back.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine.worker_memory_stats import METHOD, memory_stats, parse_flag

MiB = 1 << 20
KEYS = {"device", "allocated_bytes", "reserved_bytes", "cached_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
        "num_alloc_retries", "num_ooms", "device_free_bytes", "device_total_bytes", "peak_reset"}


class FakeAllocator:
    """torch.cuda's figures from a little model of the caching allocator: tensors take and give back bytes, the
    reserve only grows, peaks follow both until reset_peak_memory_stats."""

    def __init__(self, total: int = 24 * 1024 * MiB):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.total, self.retries, self.ooms = total, 0, 0
        self.devices: list = []  # the device argument of every call
        self.resets = 0

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, size: int) -> None:
        self.allocated -= size

    def install(self, monkeypatch) -> FakeAllocator:
        def seen(value):
            def call(device=None):
                self.devices.append(device)
                return value()
            return call

        def reset(device=None):
            self.devices.append(device)
            self.resets += 1
            self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

        # memory_stats reports more keys than these; the hook reads only its two counters
        stats = {"num_alloc_retries": lambda: self.retries, "num_ooms": lambda: self.ooms,
                 "allocated_bytes.all.current": lambda: self.allocated}
        for name, value in {
            "memory_allocated": lambda: self.allocated, "memory_reserved": lambda: self.reserved,
            "max_memory_allocated": lambda: self.peak_allocated, "max_memory_reserved": lambda: self.peak_reserved,
            "mem_get_info": lambda: (self.total - self.reserved - 300 * MiB, self.total),
            "memory_stats": lambda: {key: read() for key, read in stats.items()},
            "current_device": lambda: 0,
        }.items():
            monkeypatch.setattr(torch.cuda, name, seen(value))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        return self


@pytest.fixture
def gpu(monkeypatch) -> FakeAllocator:
    return FakeAllocator().install(monkeypatch)


def test_the_figures_are_the_allocators_in_bytes(gpu):
    gpu.alloc(5000 * MiB)
    gpu.free(1200 * MiB)  # a transient: kept in the reserve, gone from allocated
    gpu.retries, gpu.ooms = 3, 1
    got = memory_stats(torch.device("cuda:0"))
    assert set(got) == KEYS
    assert got == {
        "device": "cuda:0", "allocated_bytes": 3800 * MiB, "reserved_bytes": 5000 * MiB, "cached_bytes": 1200 * MiB,
        "peak_allocated_bytes": 5000 * MiB, "peak_reserved_bytes": 5000 * MiB, "num_alloc_retries": 3, "num_ooms": 1,
        "device_free_bytes": gpu.total - 5300 * MiB, "device_total_bytes": gpu.total, "peak_reset": False}
    assert all(type(v) is int for k, v in got.items() if k.endswith("_bytes") or k.startswith("num_"))
    assert gpu.resets == 0 and set(gpu.devices) == {torch.device("cuda:0")}  # every figure of the worker's device
    json.dumps(got)  # what /collective_rpc sends back


def test_a_reset_reads_the_window_it_closes_then_starts_a_new_one(gpu):
    gpu.alloc(2000 * MiB)
    gpu.alloc(3000 * MiB)  # warm-up peak: 5000
    gpu.free(3000 * MiB)
    closing = memory_stats(None, "1")
    assert closing["peak_allocated_bytes"] == 5000 * MiB and closing["peak_reset"] is True
    assert closing["device"] == "cuda:0" and gpu.resets == 1
    gpu.alloc(500 * MiB)  # the next window's own peak: 2500, under the warm-up's
    gpu.free(500 * MiB)
    after = memory_stats(None, "0")
    assert after["peak_allocated_bytes"] == 2500 * MiB and after["peak_reserved_bytes"] == 5000 * MiB
    assert after["peak_reset"] is False and gpu.resets == 1
    assert memory_stats(None)["peak_allocated_bytes"] == 2500 * MiB  # no argument: no reset
    assert gpu.resets == 1


@pytest.mark.parametrize("text, want", [("1", True), ("true", True), (" Yes ", True), ("on", True), (True, True),
                                        ("0", False), ("false", False), ("", False), ("no", False), (None, False),
                                        (False, False)])
def test_the_reset_argument_arrives_as_a_string(text, want):
    assert parse_flag(text) is want


def test_a_bad_argument_changes_nothing(gpu):
    gpu.alloc(100 * MiB)
    with pytest.raises(ValueError, match="reset_peak"):
        memory_stats(None, "reset")
    assert gpu.resets == 0 and gpu.devices == []


# ---------------------------------------------------------------------------------------------
# The patched Worker, as /collective_rpc reaches it


def worker_wrapper(device: torch.device):
    """A WorkerWrapperBase around a patched gpu_worker.Worker that has only its device: run_method looks the
    method up on the wrapper, whose __getattr__ hands it to the worker."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    worker = Worker.__new__(Worker)
    worker.device = device
    wrapper = WorkerWrapperBase.__new__(WorkerWrapperBase)
    wrapper.worker = worker
    return wrapper


def collective_rpc(body: dict, wrappers: list) -> tuple[int, object]:
    """vLLM's own POST /collective_rpc handler over an engine client that runs the method on each worker as the
    executors do (vllm.v1.serial_utils.run_method): (status, JSON)."""
    from vllm.entrypoints.serve.dev.rpc import api_router
    from vllm.v1.serial_utils import run_method

    class Engine:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [run_method(w, method, args, kwargs or {}) for w in wrappers]

    class Request:
        app = SimpleNamespace(state=SimpleNamespace(engine_client=Engine()))

        async def json(self):
            return body

    response = asyncio.run(api_router.collective_rpc(Request()))
    return response.status_code, json.loads(response.body)


def test_the_patched_worker_answers_collective_rpc(gpu):
    from vllm.v1.worker.gpu_worker import Worker

    assert METHOD == "qs_memory_stats" and callable(getattr(Worker, METHOD, None)), "worker-memory-stats.patch"
    gpu.alloc(900 * MiB)
    gpu.free(400 * MiB)
    wrapper = worker_wrapper(torch.device("cuda:0"))
    status, answer = collective_rpc({"method": METHOD, "args": ["1"]}, [wrapper])
    assert status == 200 and list(answer) == ["results"] and len(answer["results"]) == 1
    first = answer["results"][0]
    assert set(first) == KEYS and first["peak_reset"] is True and first["device"] == "cuda:0"
    assert first["allocated_bytes"] == 500 * MiB and first["peak_allocated_bytes"] == 900 * MiB
    assert gpu.resets == 1
    status, answer = collective_rpc({"method": METHOD, "kwargs": {"reset_peak": "0"}}, [wrapper])
    assert answer["results"][0]["peak_allocated_bytes"] == 500 * MiB and gpu.resets == 1
    status, answer = collective_rpc({"method": METHOD}, [wrapper, worker_wrapper(torch.device("cuda:1"))])
    assert [r["device"] for r in answer["results"]] == ["cuda:0", "cuda:1"]


def test_an_unpatched_worker_has_no_such_method(monkeypatch):
    """What the soak sees from a server without the patch: vLLM's run_method refuses the name."""
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.delattr(Worker, METHOD)
    with pytest.raises(NotImplementedError, match=METHOD):
        run_method(worker_wrapper(torch.device("cuda:0")), METHOD, ("1",), {})

