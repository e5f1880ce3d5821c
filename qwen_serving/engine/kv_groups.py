"""KV pool sizing for hybrid models: the KV-cache group size, and the V2 runner's CUDA-graph reserve.

vLLM splits a hybrid model's layers into buckets of one cache type and cuts every bucket into groups
of ``group_size`` layers; each block id of the shared pool is ``group_size`` pages, and a bucket
whose size is not a multiple of ``group_size`` gets padding layers. Upstream takes the smallest
bucket as the group size. With the DFlash2 drafter that is its 5 sliding-window layers, so the
target's 16 attention layers become 4 groups of 5 (20 pages per block id of context, 25% waste) and
its 48 GDN layers 10 groups of 5. A sliding-window group only ever holds window-many blocks per
request, so padding it costs a few MB per request; padding the layers that grow with the context
costs a share of the whole pool. So when sliding-window buckets are present the group size is
picked to pad the context-sized buckets (full attention, mamba/GDN) least, then the window-bounded
ones least, never below the smallest bucket (so there are never more groups than upstream makes):
16/48/5 gets groups of 8 (2 + 6 attention/GDN groups unpadded, the 5 drafter layers padded to 8).
Without window-bounded buckets upstream's choice stands.
"""

from __future__ import annotations

import math

CUDAGRAPH_ENV = "VLLM_V2_CUDAGRAPH_MEM_MIB"


def upstream_group_size(bucket_sizes: list[int]) -> int:
    """vLLM 0.28.0's rule: the smallest bucket, or the largest when it is under 1.5x the smallest."""
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * 1.5 else smallest


def padding_layers(bucket_sizes: list[int], group_size: int) -> int:
    """Padding layers needed to cut every bucket into groups of ``group_size``."""
    return sum(math.ceil(n / group_size) * group_size - n for n in bucket_sizes)


def choose_group_size(bucket_sizes: list[int], window_bounded: list[bool]) -> int:
    """Group size for buckets of ``bucket_sizes`` layers; ``window_bounded`` marks sliding-window or
    chunked-local buckets (bounded per request, cheap to pad)."""
    if not bucket_sizes or len(bucket_sizes) != len(window_bounded):
        raise ValueError("one window flag per non-empty layer bucket is needed")
    upstream = upstream_group_size(bucket_sizes)
    context_sized = [n for n, bounded in zip(bucket_sizes, window_bounded, strict=True) if not bounded]
    window_sized = [n for n, bounded in zip(bucket_sizes, window_bounded, strict=True) if bounded]
    if not context_sized or not window_sized:
        return upstream
    candidates = range(min(bucket_sizes), max(context_sized) + 1)
    return min(candidates, key=lambda g: (padding_layers(context_sized, g), padding_layers(window_sized, g), -g))


def cudagraph_reserve_bytes(raw: str) -> int:
    """Bytes the V2 runner reports for its CUDA graphs, from ``VLLM_V2_CUDAGRAPH_MEM_MIB`` (MiB;
    0, the default, is upstream's figure: the graphs then land on top of --gpu-memory-utilization)."""
    raw = raw.strip() or "0"
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"{CUDAGRAPH_ENV}={raw!r} is not a number of MiB") from None
    if not math.isfinite(mib) or mib < 0:
        raise ValueError(f"{CUDAGRAPH_ENV}={raw!r} must be a non-negative number of MiB")
    return int(mib * (1 << 20))
