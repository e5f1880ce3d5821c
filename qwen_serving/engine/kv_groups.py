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

Before grouping, vLLM gives every layer one page size: a layer whose page divides the largest one gets
a larger block (integer scaling); one whose page does not, on a backend that reads pages by their block
stride (Triton), is padded to it at its own block size. The drafter's window layers are built at the
backend's smallest kernel block (16 tokens), so under a per-token-head cache, where their 8 x 128 heads
take more bytes per token than the target's 4 x 256 (int4: 1,088 against 1,056), each 16-token window
block was padded to a whole 1.79 MB page: at int4 and 7 drafts 257 blocks a request instead of 6
(4.90 GiB held 47,488 tokens of context, not 245,760). ``padded_block_size`` fills such a page with as
many tokens as fit.
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


def padded_block_size(block_size: int, page_bytes: int, shared_page_bytes: int,
                      shared_block_sizes: list[int]) -> int:
    """Block size for an attention layer whose page (``page_bytes`` at ``block_size`` tokens) is padded up to
    ``shared_page_bytes``: the largest multiple of ``block_size`` whose page still fits and that divides the
    block size of every attention layer already at the shared page (``shared_block_sizes``), so the scheduler's
    block (the LCM of the groups' block sizes) stays theirs and the prefix-cache hash block (the GCD) divides it.
    Mamba layers are left out: without prefix caching their block is max_model_len.
    Multiples of the layer's block stay multiples of the kernel block it was built at. ``block_size`` itself
    when no larger one qualifies or no attention layer is at the shared page (upstream's padding)."""
    if not shared_block_sizes:
        return block_size
    shared = math.gcd(*shared_block_sizes)
    fitting = [m for m in range(1, shared_page_bytes // page_bytes + 1) if shared % (m * block_size) == 0]
    return block_size * max(fitting, default=1)


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
