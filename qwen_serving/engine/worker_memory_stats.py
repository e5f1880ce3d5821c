"""The GPU worker's allocator figures, kept vs needed (worker-memory-stats.patch).

nvidia-smi sees what the process holds on the device: PyTorch's caching allocator keeps every segment it ever
reserved, so a transient peak (a long prompt's prompt logprobs, say) stays as "used" long after it is gone. This
hook gives the worker's own figures: what tensors use now and what the allocator has reserved now, both peaks since
the last reset, the allocator's retries (a cudaMalloc that failed, so it freed its cache and tried again) and OOMs,
and the device's free/total. vLLM's dev API (VLLM_SERVER_DEV_MODE=1) reaches it:

    POST /collective_rpc {"method": "qs_memory_stats"}                   -> {"results": [{...}]}  (one per worker)
    POST /collective_rpc {"method": "qs_memory_stats", "args": ["1"]}    the same, then the peaks are reset

Every figure is in bytes. The peaks are read before the reset, so the answer of a resetting call covers the window
it closes; the retry and OOM counts are the allocator's running totals since the process started (a peak reset
leaves them). Memory outside PyTorch's allocator (the CUDA context, NCCL, cuBLAS workspaces of other libraries)
shows only in total - free.
"""

from __future__ import annotations

from typing import Any

METHOD = "qs_memory_stats"  # the Worker method the patch adds: the name /collective_rpc asks for
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def parse_flag(value: str | bool | int | None) -> bool:
    """A /collective_rpc argument (always a string there) as a bool; anything unrecognised is refused, so a typo
    never silently skips the reset."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(f"reset_peak must be one of {', '.join(TRUE + FALSE[:-1])} (or empty), not {value!r}")


def memory_stats(device: Any = None, reset_peak: str | bool | int | None = "0") -> dict[str, Any]:
    """The allocator's figures for ``device`` (None: the current one), in bytes; with reset_peak, its peak
    statistics are reset after they are read."""
    import torch  # here, not at the top: bench/soak.py reads METHOD without torch

    reset = parse_flag(reset_peak)  # before any reading: a bad argument changes nothing
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    allocated = int(torch.cuda.memory_allocated(device))
    reserved = int(torch.cuda.memory_reserved(device))
    result = {
        "device": str(device) if device is not None else f"cuda:{torch.cuda.current_device()}",
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        # reserved but holding no tensor: what the caching allocator merely kept
        "cached_bytes": reserved - allocated,
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "device_free_bytes": int(free),
        "device_total_bytes": int(total),
        "peak_reset": reset,
    }
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return result
