"""Bounds for the speculative-decode state indices of the GDN/Mamba layers (vLLM PR #50021's bug class).

A request's recurrent state for speculative decoding lives in a row of slots, one per query token;
the next step resumes from slot ``num_accepted_tokens - 1``. For padded batch entries or a stale
count that index can fall outside the row, and the Triton kernels then read (or write) another
request's state or memory past the tensor. The kernels clamp in-line (Triton cannot call into this
package); the host-side align-mode copies of the prefix cache use the functions here.
"""

from __future__ import annotations


def accepted_slot(num_accepted_tokens: int, num_slots: int) -> int:
    """The slot holding the state after the last accepted token, kept inside ``[0, num_slots)``."""
    if num_slots < 1:
        raise ValueError(f"a state row needs at least one slot, got {num_slots}")
    return min(max(num_accepted_tokens - 1, 0), num_slots - 1)
