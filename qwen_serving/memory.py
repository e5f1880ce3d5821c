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

from . import model
from .engine import kv_groups

GiB = 1 << 30
MiB = 1 << 20

DFLASH2_DRAFTER_BYTES = 1.19e9  # spec: W4A16 requantized drafter, 1.19 GB

KERNEL_BLOCK_ALIGNMENT = 16  # FlashAttention, FlashInfer and Triton all take multiples of 16 on sm86
PREFILL_CHUNK = 2048  # --max-num-batched-tokens in single-user mode (spec: larger chunks do not boot)

KvDtype = Literal["auto", "fp8", "int8_per_token_head", "int4_per_token_head", "kvarn"]

# KVarN (engine/kernels/kvarn.py has the format): one record per tile of 128 tokens and KV head holds 4-bit K
# codes, 2-bit V codes and fp16 scales; a tile is written once whole, so its tokens wait 16-bit in a staging
# pool, as does every request's first tile (the attention sink). As in the spec's port: the paged cache is
# KV_MEM exactly and the staging pool sits beside it (allocated in the profile run, like activations); the
# DFlash2 drafter's sliding-window layers stay bf16 (KVarN has no window path), in 128-token blocks.
KVARN_TILE = 128
KVARN_KEY_BITS, KVARN_VALUE_BITS = 4, 2


def kvarn_record_bytes(head_dim: int = model.HEAD_DIM, tile: int = KVARN_TILE) -> int:
    """One (tile, KV head) record: K codes + K row scale, row zero (per channel) and column scale (per token),
    V codes + V row scale, row zero (per token) and column scale (per channel), the scales fp16; 8-aligned."""
    codes = head_dim * tile * (KVARN_KEY_BITS + KVARN_VALUE_BITS) // 8
    scales = 2 * (2 * head_dim + tile) + 2 * (2 * tile + head_dim)
    return -(-(codes + scales) // 8) * 8


def kvarn_staging_slots(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """16-bit tiles the staging pool holds per layer: each request's sink and growing tile, the tiles one prefill
    chunk can fill before they are quantized, and 8 spare; at least 8 (the spec port's rule; upstream KVarN
    keeps 32 spare and at least 64)."""
    return max(2 * max_num_seqs + -(-max_num_batched_tokens // KVARN_TILE) + 8, 8)


def kv_bytes_per_token_layer(kv_dtype: str, kv_heads: int = model.KV_HEADS, head_dim: int = model.HEAD_DIM) -> int:
    """Bytes one token occupies in one attention layer (K and V)."""
    if kv_dtype == "kvarn":  # 210 bytes per KV head at head_dim 256: 840 for the 4 heads (bf16: 4096)
        return kvarn_record_bytes(head_dim) * kv_heads // KVARN_TILE
    if kv_dtype == "auto":
        kv_dtype = model.DTYPE
    if kv_dtype in ("bfloat16", "float16", "fp8"):
        return kv_heads * 2 * head_dim * model.DTYPE_BYTES[kv_dtype]
    if kv_dtype == "int8_per_token_head":  # int8 data + one fp32 scale per head for K and for V
        return kv_heads * (2 * head_dim + 2 * 4)
    if kv_dtype == "int4_per_token_head":  # two int4 per byte + the same fp32 scales
        return kv_heads * (head_dim + 2 * 4)
    raise ValueError(f"no page layout known for kv cache dtype {kv_dtype!r}")


def gdn_state_bytes_per_layer(state_dtype: str = "float16", spec_tokens: int = 0, conv_dtype: str = model.DTYPE,
                              tp: int = 1) -> int:
    """One request's recurrent state in one GDN layer on one of `tp` cards: the delta-rule matrix plus the conv
    tail (with k more conv rows when speculating: model.gdn_state_shapes)."""
    conv, ssm = model.gdn_state_shapes(spec_tokens, tp)
    return math.prod(ssm) * model.DTYPE_BYTES[state_dtype] + math.prod(conv) * model.DTYPE_BYTES[conv_dtype]


def gdn_state_bytes(state_dtype: str = "float16", spec_tokens: int = 0, tp: int = 1) -> int:
    """One request's recurrent state over all 48 GDN layers (unpadded), on one of `tp` cards."""
    return model.GDN_LAYERS * gdn_state_bytes_per_layer(state_dtype, spec_tokens, tp=tp)


@dataclass(frozen=True)
class CacheShape:
    """What decides the pool layout of one serving configuration."""

    kv_dtype: str = "auto"
    state_dtype: str = "float16"
    spec: Literal["off", "mtp", "dflash2"] = "off"
    spec_tokens: int = 0  # k: MTP drafts, or the DFlash2 verify block (DFLASH_TOKENS)
    prefix_cache: bool = False  # align mode: one more state page per GDN group
    kv_group_fix: bool = True  # patches/hybrid-kv-groups: the drafter's window layers no longer set the group size
    window_page_fix: bool = True  # patches/hybrid-kv-padded-window-pages: a padded window page holds what fits
    max_num_batched_tokens: int = PREFILL_CHUNK
    async_scheduling: bool = False  # two batches in flight: the window group keeps two chunks
    conv_spec_rows: bool = True  # vLLM 0.28.0 keeps k extra conv rows per GDN state; False drops them
    tp: int = 1  # cards: each holds its share of the KV heads and of the GDN channels, in a pool of its own
    max_num_seqs: int = 1  # KVarN only: its staging pool holds two 16-bit tiles per request

    @property
    def block_alignment(self) -> int:
        """The kernel block: KVarN's tile (one block must hold whole tiles), 16 tokens for the others."""
        return KVARN_TILE if self.kv_dtype == "kvarn" else KERNEL_BLOCK_ALIGNMENT

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """One card's bytes per token per attention layer (its KV heads; the drafter's 8 x 128 give the same)."""
        return kv_bytes_per_token_layer(self.kv_dtype, kv_heads=model.KV_HEADS // self.tp)

    @property
    def block_size(self) -> int:
        """Attention block size: the smallest multiple of 16 tokens whose page holds one GDN state. Both halve
        together under TP, so the block size is the one card's."""
        step = self.block_alignment * self.kv_bytes_per_token_layer
        state = gdn_state_bytes_per_layer(self.state_dtype, self.spec_tokens if self.conv_spec_rows else 0,
                                          tp=self.tp)
        return self.block_alignment * math.ceil(state / step)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer on one card; the GDN page is padded to this."""
        return self.block_size * self.kv_bytes_per_token_layer

    @property
    def buckets(self) -> dict[str, int]:
        """Layers per cache kind, as vLLM groups them."""
        attn = model.ATTN_LAYERS + (model.MTP_LAYERS if self.spec == "mtp" else 0)
        out = {"attention": attn, "gdn": model.GDN_LAYERS}
        if self.spec == "dflash2":
            out["window"] = model.DRAFTER_LAYERS
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
        return math.ceil((model.DRAFTER_WINDOW - 1 + in_flight) / self.window_block_size) + 1

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
            blocks += self.groups["window"] * min(self.window_blocks, math.ceil(max_len / self.window_block_size) + 1)
        return blocks

    @property
    def window_block_size(self) -> int:
        """Tokens per block of the drafter's window group. vLLM builds the window layers at the kernel's smallest
        block (16 tokens) and then unifies their page with the shared one (kv_cache_utils
        unify_kv_cache_spec_page_size): a page that divides the shared page is scaled up to it, which for bf16 and
        fp8 (the drafter's 8 x 128 heads take the target's bytes per token) is the attention block; one that does
        not (int8 and int4 per-token-head: one fp32 scale per head for K and V, twice the target's heads) is
        padded to it on Triton, upstream at 16 tokens a block, with the hybrid-kv-padded-window-pages patch at
        the largest divisor of the attention block that fits (kv_groups.padded_block_size). Under KVarN the
        drafter stays bf16 and its block must also divide the attention block in whole tiles (the spec port's
        kernel-block rule), which at every draft length here leaves one tile."""
        per_token = kv_bytes_per_token_layer("auto" if self.kv_dtype == "kvarn" else self.kv_dtype,
                                             model.DRAFTER_KV_HEADS // self.tp, model.DRAFTER_HEAD_DIM)
        if self.kv_dtype == "kvarn":
            fit = self.page_bytes // per_token
            return max(d for d in range(KVARN_TILE, max(fit, KVARN_TILE) + 1, KVARN_TILE) if self.block_size % d == 0)
        smallest_page = KERNEL_BLOCK_ALIGNMENT * per_token
        if self.page_bytes % smallest_page == 0:
            return KERNEL_BLOCK_ALIGNMENT * (self.page_bytes // smallest_page)
        if not self.window_page_fix:
            return KERNEL_BLOCK_ALIGNMENT
        return kv_groups.padded_block_size(KERNEL_BLOCK_ALIGNMENT, smallest_page, self.page_bytes, [self.block_size])

    def staging_bytes(self) -> int:
        """KVarN: the 16-bit staging pool on one card, beside KV_MEM: its slots (a tile of bf16 K and V each) in
        the target's attention layers and the MTP layer. 0 for the other caches."""
        if self.kv_dtype != "kvarn":
            return 0
        slot = KVARN_TILE * (model.KV_HEADS // self.tp) * model.HEAD_DIM * 2 * model.DTYPE_BYTES[model.DTYPE]
        layers = self.buckets["attention"]
        return kvarn_staging_slots(self.max_num_seqs, self.max_num_batched_tokens) * slot * layers

    def num_blocks(self, kv_mem: int) -> int:
        """Blocks of a pool of kv_mem bytes per card (vLLM's --kv-cache-memory-bytes is per card; every card
        holds the same block ids, each its share of every page)."""
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
            wbs = self.window_block_size
            decode_cap = math.ceil((model.DRAFTER_WINDOW - 1 + self.spec_tokens + 1) / wbs) + 1
            per += self.groups["window"] * min(decode_cap, math.ceil(tokens / wbs) + 1)
        return usable // per


# ---- weights ----
def _linear_params() -> dict[str, int]:
    hidden, q_dim, kv_dim = model.HIDDEN, model.Q_HEADS * model.HEAD_DIM, model.KV_HEADS * model.HEAD_DIM
    mlp = 3 * hidden * model.INTERMEDIATE
    attn = hidden * q_dim * 2 + 2 * hidden * kv_dim + q_dim * hidden  # q_proj also emits the output gate
    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (one per value head each), out_proj
    gdn = hidden * (model.CONV_DIM + model.GDN_VALUE_DIM) + hidden * 2 * model.GDN_V_HEADS + model.GDN_VALUE_DIM * hidden
    return {"mlp": mlp, "attn": attn, "gdn": gdn}


def body_params() -> int:
    p = _linear_params()
    return model.ATTN_LAYERS * (p["mlp"] + p["attn"]) + model.GDN_LAYERS * (p["mlp"] + p["gdn"])


def mtp_params() -> int:
    p = _linear_params()
    return p["mlp"] + p["attn"] + 2 * model.HIDDEN * model.HIDDEN  # one layer plus the fc that joins two hidden states


def int_bytes(params: int, bits: int, group: int = 128) -> float:
    """Packed integer weights with one fp16 scale per group."""
    return params * (bits / 8 + 2 / group)


VISION_TOWER_BYTES = 0.858 * GiB  # spec figure: the BF16 vision tower of this checkpoint (model.vision_tower_bytes)


def vision_card_bytes(offload_gib: float | None = None) -> float:
    """The vision tower's bytes on the card: all of it, or with VISION_OFFLOAD=1 its budget (`offload_gib`), the
    most engine/vision_offload.py keeps there at once, never more than the tower."""
    return VISION_TOWER_BYTES if offload_gib is None else min(offload_gib * GiB, VISION_TOWER_BYTES)


def encoder_cache_bytes(batched_tokens: int, image_tokens: int) -> int:
    """VISION=1: the encoder outputs vLLM 0.28.0 keeps on the card while it profiles the pool. Its profile run
    encodes dummy images up to the encoder budget (v1/core/encoder_cache_manager.py compute_mm_encoder_budget:
    max(--max-num-batched-tokens, one image's tokens)) and holds their BF16 rows of the text width in the encoder
    cache through the text model's dummy forward, so they count beside the activation peak. The encoder's own
    activations (its widest: 4 x one image's patches x the 4304-wide MLP) come before and are taken to stay
    under ACTIVATION_PEAK_BYTES, which the text model's dummy forward reaches (an assumption the GPU run checks)."""
    return max(batched_tokens, image_tokens) * model.HIDDEN * model.DTYPE_BYTES[model.DTYPE]


@dataclass(frozen=True)
class Weights:
    """The served weights after prepare/ (int8 embed; int8 or GPTQ-int4 lm_head), as vLLM 0.28.0 lays them out
    under TP. Split across the cards: every linear of the body and of the MTP module (column- and row-parallel,
    their group scales with them) and the vocab-parallel embed_tokens and lm_head (vocabulary rows; 248,320 is a
    multiple of 64 x 4, so no padding). Whole on every card: the DFlash2 drafter and the vision tower, whose
    split the plan does not know (an upper bound). The norms, conv1d, A_log and dt_bias are not counted
    (under 10 MB)."""

    split: float
    whole: float

    def per_card(self, tp: int = 1) -> float:
        return self.split / tp + self.whole

    @property
    def total(self) -> float:
        return self.split + self.whole


def weights(spec: str = "mtp", fast_variant: bool = True, vision: bool = False,
            vision_offload_gib: float | None = None) -> Weights:
    """With `vision`, the tower counts as vision_card_bytes(vision_offload_gib)."""
    table = model.VOCAB * model.HIDDEN
    split = int_bytes(body_params(), 4) + int_bytes(table, 8)  # body + embed_tokens
    split += int_bytes(table, 4 if fast_variant else 8)  # lm_head
    whole = 0.0
    if spec == "mtp":
        split += int_bytes(mtp_params(), 4 if fast_variant else 8)
    elif spec == "dflash2":
        whole += DFLASH2_DRAFTER_BYTES
    if vision:
        whole += vision_card_bytes(vision_offload_gib)
    return Weights(split, whole)


def weights_bytes(spec: str = "mtp", fast_variant: bool = True, vision: bool = False, tp: int = 1,
                  vision_offload_gib: float | None = None) -> float:
    """GPU bytes of the served weights on one of `tp` cards."""
    return weights(spec, fast_variant, vision, vision_offload_gib).per_card(tp)


# ---- what sits beside the KV pool on the card ----
CUDAGRAPH_BYTES = 1.2 * GiB  # spec: ~1.2 GiB of CUDA graphs on the V2 runner (the V1 figure is not stated)
ACTIVATION_PEAK_BYTES = 2.0 * GiB  # spec: the profiled activation peak swings ~1 GiB between starts; take the top
AUTO_MARGIN_BYTES = int(0.5 * GiB)  # what KV_MEM=auto leaves free on purpose
# Under TP every card keeps the whole graph and activation figures above: their tensors of hidden size are
# replicated and nothing of ours measured how much of the rest halves, so they stay an upper bound. Each card
# also holds the communicators: NCCL's (torch's group and vLLM's PyNccl) and the custom all-reduce buffers
# (custom_all_reduce.py: 8 MiB plus its graph registrations). An allowance, not a measurement.
TP_COMM_BYTES = int(0.5 * GiB)


def beside_pool_bytes(tp: int = 1) -> float:
    """What sits on each card besides the weights and the pool: graphs, activation peak, communicators."""
    return CUDAGRAPH_BYTES + ACTIVATION_PEAK_BYTES + (TP_COMM_BYTES if tp > 1 else 0)


def auto_kv_mem(free_bytes: int, weights: float, margin: int = AUTO_MARGIN_BYTES, tp: int = 1,
                encoder_cache: int = 0) -> int:
    """KV_MEM=auto on one card: its free VRAM minus its weights (weights_bytes(..., tp)), graphs, the activation
    peak, the communicators under TP, VISION=1's encoder cache (encoder_cache_bytes) and a margin, in MiB steps."""
    pool = free_bytes - weights - beside_pool_bytes(tp) - encoder_cache - margin
    return max(0, int(pool) // MiB * MiB)
