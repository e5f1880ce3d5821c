"""The V2 runner's running mamba-state column when a request starts or resumes (upstream #55600, open in 0.28.0).

Under prefix caching in align mode a hybrid model keeps one recurrent state per mamba block of the context, and
``MambaHybridModelState.add_request`` points the request at the block its computed tokens end in. Upstream divides
by ``cache_config.block_size``, but by then the engine core has set that to the smallest block size of the
prefix-cacheable KV groups. With DFlash2's sliding-window drafter beside Qwen3.8 those groups hold 1,088-token
blocks while the GDN groups keep 2,176 (tests/test_engine_gdn_state_seed.py builds them with vLLM's own grouping),
so a hit on a cached prefix seeds twice the right column: the wrong state is restored, or, past half the block-table
row, a read outside it (an illegal memory access on the GPU). The mamba groups' own block is ``mamba_block_size``,
the unit of every other mamba index (``MambaSpec.block_size``, the block table's width, the copy kernel).
"""

from __future__ import annotations

from typing import Any


def running_state_column(num_computed_tokens: int, cache_config: Any) -> int:
    """The block column holding the state after the request's last computed token (-1 before any token), in the
    mamba groups' block size; the attention block size where vLLM set no mamba block size (align mode always sets
    one, so that is upstream's own behaviour)."""
    block = cache_config.mamba_block_size or cache_config.block_size
    return (num_computed_tokens - 1) // block
