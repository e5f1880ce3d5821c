"""VISION_OFFLOAD: the vision tower's weights in (pinned) host RAM, each module copied to the GPU for its own forward.

vLLM 0.28.0 builds Qwen3.5's tower as `Qwen3_VisionTransformer` (model_executor/models/qwen3_vl.py, the
`visual` of `Qwen3_5ForConditionalGeneration`) and keeps all of it on the card: 0.858 GiB of BF16 weights,
which with SPEC=dflash2 does not leave a 24 GB card room to boot (spec). Its forward calls each module in
turn: the patch embed, then every block, then the merger (and the deepstack mergers, which Qwen3.5 has none
of). Those calls are the units this module streams: a unit's weights live in one contiguous host buffer,
one host-to-device copy stages them into one device buffer just before the unit's forward, and after it
(on an exception too) the parameters point back at the host buffer, so the device buffer is freed: the
next unit reuses the same allocator block. The unit's `forward` is wrapped on the instance (see
StreamedUnit.staged_forward for why not a forward hook).

What stays on the device whatever the budget: the patch embed (the tower's `device` and `dtype` are read
from its weight, and the input is moved to that device), the position-embedding table (read directly by
`fast_pos_embed_interpolate`, not through a module call) and the rotary cos/sin cache. These are the
tower's "fixed" bytes (9 MiB for the real tower).

The budget: the most bytes of the tower on the device at once, fixed bytes included. Units are kept on the
device for good, largest first, each one while it fits beside the fixed bytes, the units already kept and a
slot for the largest unit still streamed; the others stream through that one slot (copied in, run,
dropped). A budget that holds everything keeps the whole tower where it is (no copies, the same as no
offload); one below the fixed bytes plus the largest unit is refused. For the real tower (27 blocks of
29 MiB, an 86 MiB merger) the launcher's default 0.125 GiB keeps the merger and streams every block: 27
copies, 0.77 GiB, per encode.

The arithmetic is the tower's own, unchanged: the same modules run on parameters of the same dtype, shape
and (contiguous) strides holding the same values; only where their storage lives changes. Each parameter
sits at a 256-byte aligned offset of its buffer, at least the alignment cuBLAS and the vectorized kernels
look at, so a GPU should pick the same kernels too (tests/gpu/test_vision_offload_gpu.py compares the
encoder output bit for bit; not run on a GPU yet).

`offload_after_load` is called by patches/vision-offload.patch at the end of BaseModelLoader.load_model:
after process_weights_after_loading (which moves CPU-resident parameters to the device and back, unpinned,
and may repack them), and inside the model runner's DeviceMemoryProfiler, so the weights vLLM counts and
the KV pool it then sizes see only what stays on the card. Refused with the encoder under torch.compile or
CUDA graphs: those keep the weights' device addresses, which move here on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

GiB = 1 << 30
MiB = 1 << 20
ALIGN = 256  # bytes: every parameter's offset in a unit's buffer
TOWER = "Qwen3_VisionTransformer"  # vLLM 0.28.0's qwen3_vl.py; Qwen3_5ForConditionalGeneration.visual
ENV = "VLLM_VISION_OFFLOAD"
BUDGET_ENV = "VLLM_VISION_OFFLOAD_GIB"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers, each once."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def units(tower: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the tower's forward calls one after another and that may be streamed, by name."""
    found = [(f"blocks.{i}", block) for i, block in enumerate(tower.blocks)]
    found.append(("merger", tower.merger))
    found += [(f"deepstack_merger_list.{i}", m) for i, m in enumerate(getattr(tower, "deepstack_merger_list", ()))]
    return found


def fixed_bytes(tower: nn.Module) -> int:
    """Bytes of the tower that stay on the device: everything outside its units."""
    inside = {id(t) for _, unit in units(tower) for t in _tensors(unit)}
    return _nbytes([t for t in _tensors(tower) if id(t) not in inside])


def unit_bytes(unit: nn.Module) -> int:
    """The size of a unit's buffer (each tensor at an ALIGN-byte offset)."""
    return sum(_aligned(t.numel() * t.element_size()) for t in _tensors(unit))


def choose_kept(sizes: list[int], fixed: int, budget: int) -> set[int]:
    """Indices of the units kept on the device: largest first, each while it fits beside the fixed bytes, the
    units kept so far and the largest unit still streamed. Refuses a budget the streaming itself exceeds."""
    kept: set[int] = set()
    used = fixed
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        slot = max((sizes[j] for j in range(len(sizes)) if j != i and j not in kept), default=0)
        if used + sizes[i] + slot <= budget:
            kept.add(i)
            used += sizes[i]
    slot = max((sizes[j] for j in range(len(sizes)) if j not in kept), default=0)
    if used + slot > budget:
        need = fixed + max(sizes, default=0)
        raise ValueError(f"{BUDGET_ENV}={budget / GiB:g} is below what the vision tower needs on the device at "
                         f"once: {fixed / MiB:.1f} MiB that always stay plus its largest module "
                         f"({max(sizes, default=0) / MiB:.1f} MiB); raise it to at least "
                         f"{math.ceil(need / GiB * 1000) / 1000:g} (VISION_OFFLOAD_GIB in the launcher)")
    return kept


class StreamedUnit:
    """One unit whose weights live in a host buffer and visit the device for each of its forwards."""

    def __init__(self, module: nn.Module, device: torch.device, pin: bool):
        self.device = device
        self.tensors = _tensors(module)
        for t in self.tensors:
            if not t.is_contiguous():
                raise ValueError(f"vision offload copies contiguous weights only; a {tuple(t.shape)} tensor of "
                                 f"{type(module).__name__} is not (set {ENV}=0: VISION_OFFLOAD=0 in the launcher)")
        self.layout: list[tuple[int, int]] = []  # (offset, bytes) of each tensor in the buffer
        offset = 0
        for t in self.tensors:
            size = t.numel() * t.element_size()
            self.layout.append((offset, size))
            offset += _aligned(size)
        self.nbytes = offset
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_views = self._views(self.host)
        for t, view in zip(self.tensors, self.host_views, strict=True):
            view.copy_(t.data)
            t.data = view  # the device copy vLLM loaded is freed here
        self.forward = module.forward
        module.forward = self.staged_forward  # see staged_forward: not a forward hook

    def staged_forward(self, *args, **kwargs):
        """The unit's own forward on weights staged on the device. An instance attribute rather than a forward
        hook: vLLM's @support_torch_compile (on Qwen3_VisionBlock and the patch embed) replaces the class's
        __call__ and, with the encoder not compiled, calls `self.forward` directly, so nn.Module hooks never run."""
        self.stage()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.release()

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[offset:offset + size].view(t.dtype).view(t.shape)
                for t, (offset, size) in zip(self.tensors, self.layout, strict=True)]

    def stage(self) -> None:
        staged = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        staged.copy_(self.host, non_blocking=True)  # ordered before the forward's kernels on the same stream
        for t, view in zip(self.tensors, self._views(staged), strict=True):
            t.data = view

    def release(self) -> None:
        for t, view in zip(self.tensors, self.host_views, strict=True):
            t.data = view


@dataclass(frozen=True)
class Offloaded:
    """What `offload` did to a tower: the units it streams and what stays on the device."""

    streamed: dict[str, StreamedUnit]
    kept: tuple[str, ...]
    fixed_bytes: int
    kept_bytes: int
    slot_bytes: int  # the largest streamed unit's buffer: at most one is on the device at a time
    pinned: bool  # whether the host buffers are page-locked (then each copy is one asynchronous DMA)

    @property
    def peak_bytes(self) -> int:
        """The most bytes of the tower on the device at once."""
        return self.fixed_bytes + self.kept_bytes + self.slot_bytes

    @property
    def host_bytes(self) -> int:
        return sum(unit.nbytes for unit in self.streamed.values())


def offload(tower: nn.Module, budget_bytes: int) -> Offloaded:
    """Move the tower's units to host buffers (pinned where the device is a GPU and pinning is available)
    and hook each streamed unit's forward; the budget is used as the module docstring says."""
    from vllm.utils.platform_utils import is_pin_memory_available

    device = tower.patch_embed.proj.weight.device
    named = units(tower)
    sizes = [unit_bytes(unit) for _, unit in named]
    fixed = fixed_bytes(tower)
    kept = choose_kept(sizes, fixed, budget_bytes)
    pin = device.type == "cuda" and is_pin_memory_available()
    streamed = {name: StreamedUnit(unit, device, pin) for i, (name, unit) in enumerate(named) if i not in kept}
    return Offloaded(streamed, tuple(named[i][0] for i in sorted(kept)), fixed, sum(sizes[i] for i in kept),
                     max((sizes[i] for i in range(len(named)) if i not in kept), default=0), pin)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The model's built vision tower, or None (a text-only model, a drafter, or --language-model-only)."""
    tower = getattr(model, "visual", None)
    return tower if type(tower).__name__ == TOWER else None


def _encoder_compiled(vllm_config) -> bool:
    compilation = vllm_config.compilation_config
    return bool(getattr(compilation, "compile_mm_encoder", False) or getattr(compilation, "cudagraph_mm_encoder", False))


def offload_after_load(model: nn.Module, vllm_config) -> Offloaded | None:
    """patches/vision-offload.patch, with VLLM_VISION_OFFLOAD=1: offload the loaded model's vision tower within
    VLLM_VISION_OFFLOAD_GIB and give the freed device memory back before vLLM measures the model."""
    import vllm.envs as envs
    from vllm.logger import init_logger

    tower = vision_tower(model)
    if tower is None:
        return None
    if _encoder_compiled(vllm_config):
        raise ValueError(f"{ENV}=1 moves the vision weights on every encode, and the encoder is compiled or "
                         "captured in CUDA graphs (compile_mm_encoder / cudagraph_mm_encoder), which keep their "
                         f"addresses; turn those off or set {ENV}=0")
    done = offload(tower, int(envs.VLLM_VISION_OFFLOAD_GIB * GiB))
    if tower.patch_embed.proj.weight.is_cuda:
        torch.cuda.empty_cache()
    init_logger(f"vllm.{__name__}").info(  # under vLLM's logger: the line lands in the server log
        "vision offload: %.0f MiB of the tower in %s host RAM (%d modules, copied in for each forward); on the "
        "device at most %.0f MiB (%.0f fixed + %.0f kept: %s + one %.0f MiB slot), budget %.3f GiB",
        done.host_bytes / MiB, "pinned" if done.pinned else "pageable", len(done.streamed), done.peak_bytes / MiB, done.fixed_bytes / MiB, done.kept_bytes / MiB,
        ", ".join(done.kept) or "none", done.slot_bytes / MiB, envs.VLLM_VISION_OFFLOAD_GIB)
    return done

