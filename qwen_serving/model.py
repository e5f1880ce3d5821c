"""Qwen3.8-27B, written once: dimensions, layer pattern, the MTP layer, GDN state shapes, bytes per dtype.

The text model of the public W4A16 AutoRound export (`dbirks/Qwen3.8-27B-W4A16-AutoRound`); the
config.json `text_config` name of each figure is beside it. The memory model (memory.py), the
synthetic `shape` and `full` checkpoints (checkpoint/synth.py) and bench/ read these numbers;
tests/test_model.py checks them against the synthetic config, vLLM 0.28.0's state-shape arithmetic
and the spec. A planning module of the package root: standard library only, so dtypes are names and
DTYPE_BYTES turns them into bytes.
"""

from __future__ import annotations

import math

# ---- the text model ----
HIDDEN = 5120  # hidden_size
INTERMEDIATE = 17408  # intermediate_size (the SiLU MLP of every layer)
VOCAB = 248_320  # vocab_size; embed_tokens and lm_head are untied (tie_word_embeddings false)
MAX_POSITIONS = 262_144  # max_position_embeddings
DTYPE = "bfloat16"  # dtype: activations, the GDN conv state, and the KV cache at cache dtype "auto"
CHECKPOINT_SSM_DTYPE = "float32"  # mamba_ssm_dtype: the GDN state vLLM keeps without --mamba-ssm-cache-dtype

# full attention, with Qwen3.5's output gate (attn_output_gate: q_proj emits 2 x Q_HEADS x HEAD_DIM)
Q_HEADS = 24  # num_attention_heads
KV_HEADS = 4  # num_key_value_heads
HEAD_DIM = 256  # head_dim

# Gated DeltaNet (linear attention)
GDN_K_HEADS = 16  # linear_num_key_heads
GDN_V_HEADS = 48  # linear_num_value_heads
GDN_HEAD_DIM = 128  # linear_key_head_dim = linear_value_head_dim
CONV_KERNEL = 4  # linear_conv_kernel_dim
GDN_KEY_DIM = GDN_K_HEADS * GDN_HEAD_DIM
GDN_VALUE_DIM = GDN_V_HEADS * GDN_HEAD_DIM
CONV_DIM = 2 * GDN_KEY_DIM + GDN_VALUE_DIM  # q, k and v go through the short conv

# ---- layer pattern ----
LAYERS = 64  # num_hidden_layers
FULL_ATTENTION_INTERVAL = 4  # full_attention_interval: three Gated DeltaNet layers, then one full attention
MTP_LAYERS = 1  # mtp_num_hidden_layers: one bf16 full-attention decoder layer; its KV joins the target's


def layer_types(num_layers: int = LAYERS) -> list[str]:
    """config.json's `layer_types` for `num_layers` layers of the repeating pattern."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention" for i in range(num_layers)
    ]


ATTN_LAYERS = layer_types().count("full_attention")
GDN_LAYERS = layer_types().count("linear_attention")


def gdn_state_shapes(spec_tokens: int = 0, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One request's recurrent state in one GDN layer on one of `tp` cards: (conv tail, delta-rule matrix).

    The conv tail is CONV_KERNEL - 1 rows of every q/k/v channel, plus one row per speculative token
    (vLLM 0.28.0's qwen3_5.py passes num_spec to the shape); the matrix is [value heads, value dim,
    key dim]. vLLM's MambaStateShapeCalculator.gated_delta_net_state_shape, conv rows first: each card
    keeps its share of the channels and of the value heads.
    """
    return (CONV_KERNEL - 1 + spec_tokens, CONV_DIM // tp), (GDN_V_HEADS // tp, GDN_HEAD_DIM, GDN_HEAD_DIM)


# ---- tensor parallelism: what vLLM 0.28.0 splits across TP cards, and the unit each card's share must be ----
# Heads: qwen3_next.py Qwen3NextAttention (query heads divide; KV heads divide, or vLLM replicates them when
# TP exceeds their count, which gives every card a whole copy of a head: not planned here) and
# qwen_gdn_linear_attn.py (divide(num_v_heads, tp), num_k_heads // tp). Columns: Marlin's tiles
# (marlin_utils.py GPTQ_MARLIN_MIN_THREAD_N = 64 outputs, GPTQ_MARLIN_MIN_THREAD_K = 128 inputs per card), and
# vocab_parallel_embedding.py pads the vocabulary to 64 rows before dividing it (a `divide` that asserts).
MARLIN_MIN_N = 64
MARLIN_MIN_K = 128
VOCAB_PADDING = 64


def padded_vocab(rows: int) -> int:
    """Rows of a vocab-parallel table (embed_tokens, lm_head, a draft head) before vLLM divides them."""
    return -(-rows // VOCAB_PADDING) * VOCAB_PADDING


def head_splits(rows: int, tp: int) -> bool:
    """A quantized vocab-parallel head of `rows` rows (lm_head, the MTP draft head) meets Marlin's tile on each of
    `tp` cards."""
    padded = padded_vocab(rows)
    return padded % tp == 0 and padded // tp % MARLIN_MIN_N == 0


# (what is split, how many, the multiple each card's share must be)
TP_SPLITS: tuple[tuple[str, int, int], ...] = (
    ("full-attention KV heads", KV_HEADS, 1),
    ("full-attention query heads", Q_HEADS, 1),
    ("GDN key heads", GDN_K_HEADS, 1),
    ("GDN value heads", GDN_V_HEADS, 1),
    ("MLP columns (Marlin: 128 per tile)", INTERMEDIATE, MARLIN_MIN_K),
    ("vocabulary rows of embed_tokens and lm_head (Marlin: 64 per tile)", padded_vocab(VOCAB), MARLIN_MIN_N),
)
TP_TRIED = (1, 2, 3, 4, 5, 6, 7, 8)  # the card counts tp_sizes() looks at


def tp_problems(tp: int, splits: tuple[tuple[str, int, int], ...] = TP_SPLITS) -> list[str]:
    """Why the model does not split across `tp` cards (empty: it does)."""
    out = []
    for what, total, unit in splits:
        if total % tp:
            out.append(f"{total:,} {what} do not divide by {tp}")
        elif (total // tp) % unit:
            out.append(f"{total:,} {what} give {total // tp:,} per card, not a multiple of {unit}")
    return out


def tp_sizes(splits: tuple[tuple[str, int, int], ...] = TP_SPLITS) -> tuple[int, ...]:
    """The card counts the model splits across."""
    return tuple(tp for tp in TP_TRIED if not tp_problems(tp, splits))


# ---- the vision tower (vision_config) ----
# Qwen3.5's ViT as vLLM 0.28.0's qwen3_vl.py Qwen3_VisionTransformer builds it: a Conv3d patch embed over
# 2 frames x 16 x 16 pixels, learned position embeddings on a 48 x 48 grid (interpolated to the image),
# 27 pre-LayerNorm blocks (fused qkv with bias, 2D RoPE, GELU-tanh MLP with bias), then a merger that
# concatenates 2 x 2 neighbouring patches, LayerNorms and projects them to the text width through a GELU
# MLP. No deepstack_visual_indexes: Qwen3.5's config has none, so the tower emits only the merger's rows.
# VISION=0 serves --language-model-only and never builds it; the synthetic checkpoints write it (synth.py).
VISION_CONFIG = {
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "model_type": "qwen3_5",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": HIDDEN,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def vision_tensor_shapes(config: dict = VISION_CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower by its checkpoint name (`model.visual.` dropped), in module order. All are
    BF16 in the export; the linears are in the quantization config's `ignore`."""
    width, mlp, depth = config["hidden_size"], config["intermediate_size"], config["depth"]
    merged = width * config["spatial_merge_size"] ** 2  # the merger's input: 2 x 2 patches side by side
    patch = (config["in_channels"], config["temporal_patch_size"], config["patch_size"], config["patch_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (width, *patch),
        "patch_embed.proj.bias": (width,),
        "pos_embed.weight": (config["num_position_embeddings"], width),
    }

    def linear(name: str, out_features: int, in_features: int) -> None:
        shapes[f"{name}.weight"] = (out_features, in_features)
        shapes[f"{name}.bias"] = (out_features,)

    def layer_norm(name: str, size: int) -> None:
        shapes[f"{name}.weight"] = (size,)
        shapes[f"{name}.bias"] = (size,)

    for i in range(depth):
        block = f"blocks.{i}"
        layer_norm(f"{block}.norm1", width)
        layer_norm(f"{block}.norm2", width)
        linear(f"{block}.attn.qkv", 3 * width, width)
        linear(f"{block}.attn.proj", width, width)
        linear(f"{block}.mlp.linear_fc1", mlp, width)
        linear(f"{block}.mlp.linear_fc2", width, mlp)
    layer_norm("merger.norm", width)
    linear("merger.linear_fc1", merged, merged)
    linear("merger.linear_fc2", config["out_hidden_size"], merged)
    return shapes


def vision_tower_bytes(config: dict = VISION_CONFIG) -> int:
    """The tower's BF16 weights in bytes (921,460,192 for the real tower: the spec's 0.858 GiB)."""
    return sum(math.prod(shape) for shape in vision_tensor_shapes(config).values()) * DTYPE_BYTES[DTYPE]


VISION_ROTARY_POSITIONS = 8192  # vLLM 0.28.0's qwen3_vl.py builds the tower's rotary cos/sin cache this long
VISION_OFFLOAD_ALIGN = 256  # bytes: the offset of each tensor in a streamed module's buffer (engine/vision_offload.py)


def vision_offload_floor_bytes(config: dict = VISION_CONFIG) -> int:
    """VISION_OFFLOAD=1: the least of the tower the card holds at once (engine/vision_offload.py). What always
    stays (patch embed, position table, the BF16 rotary cache of head_dim / 2 cos and sin values per position)
    plus the largest module it streams (a block or the merger), each tensor at an aligned offset of its buffer."""
    shapes = vision_tensor_shapes(config)
    element = DTYPE_BYTES[DTYPE]

    def buffer(prefix: str) -> int:
        return sum(-(-math.prod(shape) * element // VISION_OFFLOAD_ALIGN) * VISION_OFFLOAD_ALIGN
                   for name, shape in shapes.items() if name.startswith(prefix))

    stays = sum(math.prod(shape) for name, shape in shapes.items() if name.startswith(("patch_embed.", "pos_embed.")))
    rotary = VISION_ROTARY_POSITIONS * config["hidden_size"] // config["num_heads"] // 2
    return (stays + rotary) * element + max(buffer("blocks.0."), buffer("merger."))


# ---- the DFlash2 drafter (SPEC=dflash2) ----
# 5 Qwen3-style sliding-window layers. Its 8 KV heads x 128 give the same bytes per token as the target's
# 4 x 256, so its pages line up with the target's (taken from the design probe
# ../shared/design/cpu-venv/kvgroups.py, not read from the checkpoint).
DRAFTER_LAYERS = 5
DRAFTER_KV_HEADS = 8
DRAFTER_HEAD_DIM = 128
DRAFTER_WINDOW = 2048
DRAFTER_TP_SPLITS = (("DFlash2 drafter KV heads", DRAFTER_KV_HEADS, 1),)

# ---- bytes per element ----
# The dtype names vLLM 0.28.0 takes for the model (--dtype), the KV cache (config/cache.py CacheDType;
# fp8 is fp8_e4m3) and the GDN state (MambaDType). The per-token-head KV layouts keep scales beside
# their data: memory.kv_bytes_per_token_layer.
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}
