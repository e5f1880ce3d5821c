"""Memory model of Qwen3.8-27B on vLLM 0.28.0: weights, KV pool, recurrent-state pages, seats.

Everything is derived from the architecture and from vLLM 0.28.0's own allocator arithmetic
(platforms/interface.py `_align_hybrid_block_size`, v1/core/kv_cache_utils.py grouping and
capacity, v1/kv_cache_interface.py specs), not fitted to the spec's figures. The tests compare
the results with the spec's reference RTX 3090 figures and explain every miss.

How vLLM lays out a hybrid model's cache: every layer's page (one block of tokens of one layer)
has the same byte size; the attention block size is the smallest multiple of 16 whose page
holds one GDN state, and the GDN page is padded to it. Layers are split into groups of
`group_size` layers of one kind; a block of the shared pool is `group_size` pages and belongs
to one group at a time. A request holds, per attention group, one block per `block_size`
tokens; per GDN group, 1 + k blocks (k = speculative tokens; 2 + k with prefix caching in
align mode); per sliding-window group, the blocks of its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .engine import kv_groups

GiB = 1 << 30
MiB = 1 << 20

# ---- architecture (Qwen3.8-27B text model; the synthetic `shape` checkpoint uses the same) ----
ATTN_LAYERS = 16  # full attention, every 4th layer
GDN_LAYERS = 48  # Gated DeltaNet
HIDDEN = 5120
INTERMEDIATE = 17408
VOCAB = 248_320
Q_HEADS = 24
KV_HEADS = 4
HEAD_DIM = 256
GDN_K_HEADS = 16
GDN_V_HEADS = 48
GDN_HEAD_DIM = 128
CONV_KERNEL = 4
CONV_DIM = 2 * GDN_K_HEADS * GDN_HEAD_DIM + GDN_V_HEADS * GDN_HEAD_DIM  # q, k and v go through the conv
MTP_ATTN_LAYERS = 1  # the MTP module is one full transformer layer; its KV joins the target's

# The DFlash2 drafter: 5 Qwen3-style sliding-window layers. Its 8 KV heads x 128 give the same
# bytes per token as the target's 4 x 256, so its pages line up with the target's (taken from
# the design probe ../shared/design/cpu-venv/kvgroups.py, not read from the checkpoint).
DRAFTER_LAYERS = 5
DRAFTER_KV_HEADS = 8
DRAFTER_HEAD_DIM = 128
DRAFTER_WINDOW = 2048
DFLASH2_DRAFTER_BYTES = 1.19e9  # spec: W4A16 requantized drafter, 1.19 GB

KERNEL_BLOCK_ALIGNMENT = 16  # FlashAttention, FlashInfer and Triton all take multiples of 16 on sm86
PREFILL_CHUNK = 2048  # --max-num-batched-tokens in single-user mode (spec: larger chunks do not boot)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

KvDtype = Literal["auto", "fp8", "int8_per_token_head", "int4_per_token_head", "kvarn"]


def kv_bytes_per_token_layer(kv_dtype: str, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> int:
    """Bytes one token occupies in one attention layer (K and V)."""
    if kv_dtype in ("auto", "bfloat16", "float16"):
        return kv_heads * 2 * head_dim * 2
    if kv_dtype == "fp8":
        return kv_heads * 2 * head_dim
    if kv_dtype == "int8_per_token_head":  # int8 data + one fp32 scale per head for K and for V
        return kv_heads * (2 * head_dim + 2 * 4)
    if kv_dtype == "int4_per_token_head":  # two int4 per byte + the same fp32 scales
        return kv_heads * (head_dim + 2 * 4)
    raise ValueError(f"no page layout known for kv cache dtype {kv_dtype!r}")


def gdn_state_bytes_per_layer(state_dtype: str = "float16", spec_tokens: int = 0, conv_dtype: str = "bfloat16") -> int:
    """One request's recurrent state in one GDN layer: the delta-rule matrix plus the conv tail.

    vLLM 0.28.0 keeps k more conv rows when speculating (qwen3_5.py passes num_spec to the shape).
    """
    ssm = GDN_V_HEADS * GDN_HEAD_DIM * GDN_HEAD_DIM * DTYPE_BYTES[state_dtype]
    conv = (CONV_KERNEL - 1 + spec_tokens) * CONV_DIM * DTYPE_BYTES[conv_dtype]
    return ssm + conv


def gdn_state_bytes(state_dtype: str = "float16", spec_tokens: int = 0) -> int:
    """One request's recurrent state over all 48 GDN layers (unpadded)."""
    return GDN_LAYERS * gdn_state_bytes_per_layer(state_dtype, spec_tokens)


@dataclass(frozen=True)
class CacheShape:
    """What decides the pool layout of one serving configuration."""

    kv_dtype: str = "auto"
    state_dtype: str = "float16"
    spec: Literal["off", "mtp", "dflash2"] = "off"
    spec_tokens: int = 0  # k: MTP drafts, or the DFlash2 verify block (DFLASH_TOKENS)
    prefix_cache: bool = False  # align mode: one more state page per GDN group
    kv_group_fix: bool = True  # patches/hybrid-kv-groups: the drafter's window layers no longer set the group size
    max_num_batched_tokens: int = PREFILL_CHUNK
    async_scheduling: bool = False  # two batches in flight: the window group keeps two chunks
    conv_spec_rows: bool = True  # vLLM 0.28.0 keeps k extra conv rows per GDN state; False drops them

    @property
    def block_size(self) -> int:
        """Attention block size: the smallest multiple of 16 tokens whose page holds one GDN state."""
        per_token = kv_bytes_per_token_layer(self.kv_dtype)
        step = KERNEL_BLOCK_ALIGNMENT * per_token
        state = gdn_state_bytes_per_layer(self.state_dtype, self.spec_tokens if self.conv_spec_rows else 0)
        return KERNEL_BLOCK_ALIGNMENT * math.ceil(state / step)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer; the GDN page is padded to this."""
        return self.block_size * kv_bytes_per_token_layer(self.kv_dtype)

    @property
    def buckets(self) -> dict[str, int]:
        """Layers per cache kind, as vLLM groups them."""
        attn = ATTN_LAYERS + (MTP_ATTN_LAYERS if self.spec == "mtp" else 0)
        out = {"attention": attn, "gdn": GDN_LAYERS}
        if self.spec == "dflash2":
            out["window"] = DRAFTER_LAYERS
        return out

    @property
    def group_size(self) -> int:
        """Layers per KV group: upstream's rule, or with the fix the one the hybrid-kv-groups patch uses."""
        sizes = list(self.buckets.values())
        if self.kv_group_fix:
            return kv_groups.choose_group_size(sizes, [kind == "window" for kind in self.buckets])
        return kv_groups.upstream_group_size(sizes)

    @property
    def groups(self) -> dict[str, int]:
        return {kind: math.ceil(n / self.group_size) for kind, n in self.buckets.items()}

    @property
    def block_bytes(self) -> int:
        """One block of the shared pool: one page for each of `group_size` layers."""
        return self.page_bytes * self.group_size

    @property
    def state_blocks_per_group(self) -> int:
        return (2 if self.prefix_cache else 1) + self.spec_tokens

    @property
    def window_blocks(self) -> int:
        """Blocks a window group keeps per request (vLLM's admission cap for sliding windows)."""
        in_flight = (2 if self.async_scheduling else 1) * self.max_num_batched_tokens
        return math.ceil((DRAFTER_WINDOW - 1 + in_flight) / self.block_size) + 1

    def resident_blocks(self) -> int:
        """Blocks a request holds before it stores one token: state pages (+ the drafter's window)."""
        g = self.groups
        blocks = g["gdn"] * self.state_blocks_per_group
        if "window" in g:
            blocks += g["window"] * self.window_blocks
        return blocks

    def resident_bytes(self) -> int:
        return self.resident_blocks() * self.block_bytes

    def context_blocks(self, tokens: int) -> int:
        return self.groups["attention"] * math.ceil(tokens / self.block_size)

    def blocks_per_request(self, max_len: int) -> int:
        """What vLLM reserves per request at max_len (the capacity report's divisor)."""
        blocks = self.context_blocks(max_len) + self.groups["gdn"] * self.state_blocks_per_group
        if "window" in self.groups:
            blocks += self.groups["window"] * min(self.window_blocks, math.ceil(max_len / self.block_size) + 1)
        return blocks

    def num_blocks(self, kv_mem: int) -> int:
        return kv_mem // self.page_bytes // self.group_size

    def pool_tokens(self, kv_mem: int, max_len: int) -> int:
        """The 'GPU KV cache size: N tokens' line vLLM 0.28.0 prints at boot."""
        return int(self.num_blocks(kv_mem) / self.blocks_per_request(max_len) * max_len)

    def bytes_per_token(self, kv_mem: int, max_len: int) -> float:
        return kv_mem / self.pool_tokens(kv_mem, max_len)

    def context_bytes_per_token(self) -> float:
        """Marginal pool bytes per token of context (attention groups only, padding included)."""
        return self.groups["attention"] * self.block_bytes / self.block_size

    def longest_context(self, kv_mem: int) -> int:
        """The largest max_model_len one request can hold in this pool, rounded down to 1024."""
        fixed = self.groups["gdn"] * self.state_blocks_per_group + self.groups.get("window", 0) * self.window_blocks
        free = self.num_blocks(kv_mem) - fixed
        tokens = max(0, free // self.groups["attention"]) * self.block_size
        return tokens // 1024 * 1024

    def fits(self, kv_mem: int, max_len: int) -> bool:
        return self.blocks_per_request(max_len) <= self.num_blocks(kv_mem)

    def residents(self, kv_mem: int, prompt: int, answer: int = 256) -> int:
        """Requests resident at once while decoding, each holding `prompt` + `answer` tokens.

        Counted at steady decode: one step of k + 1 tokens is in flight, so a window group holds
        its window plus that step (vLLM's admission cap with in-flight = k + 1), never more than
        the request's own tokens plus the block a misaligned window start costs.
        """
        usable = self.num_blocks(kv_mem) - 1  # block 0 is vLLM's null block
        tokens = prompt + answer + self.spec_tokens
        per = self.context_blocks(tokens) + self.groups["gdn"] * self.state_blocks_per_group
        if "window" in self.groups:
            decode_cap = math.ceil((DRAFTER_WINDOW - 1 + self.spec_tokens + 1) / self.block_size) + 1
            per += self.groups["window"] * min(decode_cap, math.ceil(tokens / self.block_size) + 1)
        return usable // per


# ---- weights ----
def _linear_params() -> dict[str, int]:
    mlp = 3 * HIDDEN * INTERMEDIATE
    attn = HIDDEN * (Q_HEADS * HEAD_DIM * 2) + 2 * HIDDEN * KV_HEADS * HEAD_DIM + Q_HEADS * HEAD_DIM * HIDDEN
    key_dim, value_dim = GDN_K_HEADS * GDN_HEAD_DIM, GDN_V_HEADS * GDN_HEAD_DIM
    gdn = HIDDEN * (2 * key_dim + 2 * value_dim) + HIDDEN * 2 * GDN_V_HEADS + value_dim * HIDDEN
    return {"mlp": mlp, "attn": attn, "gdn": gdn}


def body_params() -> int:
    p = _linear_params()
    return ATTN_LAYERS * (p["mlp"] + p["attn"]) + GDN_LAYERS * (p["mlp"] + p["gdn"])


def mtp_params() -> int:
    p = _linear_params()
    return p["mlp"] + p["attn"] + 2 * HIDDEN * HIDDEN  # one layer plus the fc that joins two hidden states


def int_bytes(params: int, bits: int, group: int = 128) -> float:
    """Packed integer weights with one fp16 scale per group."""
    return params * (bits / 8 + 2 / group)


VISION_TOWER_BYTES = 0.858 * GiB  # spec figure: the BF16 vision tower of this checkpoint


def weights_bytes(spec: str = "mtp", fast_variant: bool = True, vision: bool = False) -> float:
    """GPU bytes of the served weights after prepare/ (int8 embed; int8 or GPTQ-int4 lm_head)."""
    table = VOCAB * HIDDEN
    total = int_bytes(body_params(), 4) + int_bytes(table, 8)  # body + embed_tokens
    total += int_bytes(table, 4 if fast_variant else 8)  # lm_head
    if spec == "mtp":
        total += int_bytes(mtp_params(), 4 if fast_variant else 8)
    elif spec == "dflash2":
        total += DFLASH2_DRAFTER_BYTES
    if vision:
        total += VISION_TOWER_BYTES
    return total


# ---- what sits beside the KV pool on the card ----
CUDAGRAPH_BYTES = 1.2 * GiB  # spec: ~1.2 GiB of CUDA graphs on the V2 runner (the V1 figure is not stated)
ACTIVATION_PEAK_BYTES = 2.0 * GiB  # spec: the profiled activation peak swings ~1 GiB between starts; take the top
AUTO_MARGIN_BYTES = int(0.5 * GiB)  # what KV_MEM=auto leaves free on purpose


def auto_kv_mem(free_bytes: int, weights: float, margin: int = AUTO_MARGIN_BYTES) -> int:
    """KV_MEM=auto: free VRAM minus weights, graphs, the activation peak and a margin, in MiB steps."""
    pool = free_bytes - weights - CUDAGRAPH_BYTES - ACTIVATION_PEAK_BYTES - margin
    return max(0, int(pool) // MiB * MiB)
