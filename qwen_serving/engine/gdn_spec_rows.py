"""The speculating requests' rows of a GDN metadata tensor, without waiting for the GPU.

vLLM 0.28.0's GDN metadata builder (``v1/attention/backends/gdn_attn.py``) picks the speculating requests' rows
of the block table and of the accepted-token counts with a boolean mask that lives on the host. Indexing a GPU
tensor with a host mask copies the mask's indices to the GPU from pageable memory, and that copy waits for the
stream: with asynchronous scheduling the host then idles until the previous step's draft passes are done, once
per GDN KV-cache group. When the speculating requests are the batch's first rows (vLLM keeps padded rows at the
back), the same rows are a slice, and a device-side copy of it gives the same fresh, contiguous tensor.
"""

from __future__ import annotations

import torch


def spec_rows(tensor: torch.Tensor, spec_mask_cpu: torch.Tensor, num_spec: int) -> torch.Tensor:
    """``tensor[spec_mask_cpu]``: the same values in a new contiguous tensor; a slice and a device-side copy when
    the mask's True entries are its first ``num_spec`` (its count), else vLLM's own mask indexing."""
    if spec_mask_cpu.device.type != "cpu" or spec_mask_cpu.dtype != torch.bool:
        raise TypeError(f"spec_rows takes a boolean mask on the host, got {spec_mask_cpu.dtype} on "
                        f"{spec_mask_cpu.device}")
    if 0 <= num_spec <= spec_mask_cpu.numel() and bool(spec_mask_cpu[:num_spec].all()) and not bool(
            spec_mask_cpu[num_spec:].any()):
        return tensor[:num_spec].clone(memory_format=torch.contiguous_format)
    return tensor[spec_mask_cpu]
