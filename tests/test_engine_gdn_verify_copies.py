"""qwen_serving.engine.gdn_verify_copies (gdn-verify-copies.patch): the GDN layer's core on a batch of speculative
decodes only, with two copies of q, k, v where vLLM runs three and a cat, and the recurrent kernel writing into
``core_attn_out`` (no final copy), is bit-identical to vLLM 0.28.0's ``_forward_core``.

vLLM's side is its own ``_forward_core`` as it ships (the pristine file's source, compiled into the patched layer
module so both look up the same kernels). Both run vLLM's real Triton kernels under TRITON_INTERPRET=1: the conv
update (vLLM binds its CPU op on a CPU host, so the Triton wrapper is loaded from the module's source) and
``fused_sigmoid_gating_delta_rule_update``. Metadata comes from the real GDN builder. Only the prefill kernels of
the mixed batch, which the patched path never runs, are deterministic stand-ins, the same on both sides.
"""

from __future__ import annotations

import ast
import difflib
import os
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from qwen_serving.engine import gdn_verify_copies
from tests.helpers.aten_ops import RecordOps
from tests.helpers.gdn_builder import builder_config

LAYER_FILE = Path("model_executor") / "layers" / "mamba" / "gdn" / "qwen_gdn_linear_attn.py"
PREFIX = "model.layers.0.linear_attn"
HK, HV, DK, DV, WIDTH = 2, 6, 16, 16, 4  # the 27B's 1:3 k:v heads, small
KEY_DIM, VALUE_DIM = HK * DK, HV * DV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
MAX_NUM_SEQS = 8
DTYPE = torch.float32  # the model's dtype here: the interpreted conv kernel returns garbage on bf16 (CPU only)
COPY_OPS = {"copy_", "clone", "cat", "index_copy", "index_copy_", "index_select", "_to_copy"}


@pytest.fixture(scope="module")
def gdn():
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    return qwen_gdn_linear_attn


@pytest.fixture(scope="module")
def vllm_forward_core(gdn):
    """vLLM 0.28.0's ``_forward_core`` from the pristine file, its globals the patched module's."""
    source = (Path(os.environ["QS_PRISTINE_VLLM"]) / LAYER_FILE).read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)
               and n.name == "QwenGatedDeltaNetAttention")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_forward_core")
    defined: dict = {}
    exec(compile(textwrap.dedent(ast.get_source_segment(source, fn)), "pristine _forward_core", "exec"),
         gdn.__dict__, defined)
    return defined["_forward_core"]


@pytest.fixture(scope="module")
def triton_conv_update():
    """vLLM's Triton ``causal_conv1d_update`` (its module rebinds the name to a CPU op on a CPU host)."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d

    source = Path(causal_conv1d.__file__).read_text()
    module = types.ModuleType("triton_causal_conv1d")
    module.__file__ = causal_conv1d.__file__
    exec(compile(source[: source.rindex("\nif current_platform.is_cpu():")], causal_conv1d.__file__, "exec"),
         module.__dict__)
    return module.causal_conv1d_update


@pytest.fixture
def kernels(gdn, triton_conv_update, monkeypatch):
    """The layer module's kernels as both versions call them; records each recurrent call's keyword names."""
    recurrent = gdn.fused_sigmoid_gating_delta_rule_update
    calls: list[set[str]] = []

    def conv_update(*args, **kwargs):
        with _disable_current_modes():
            return triton_conv_update(*args, **kwargs)

    def gating(**kwargs):
        calls.append(set(kwargs))
        with _disable_current_modes():
            return recurrent(**kwargs)

    monkeypatch.setattr(gdn, "causal_conv1d_update", conv_update)
    monkeypatch.setattr(gdn, "fused_sigmoid_gating_delta_rule_update", gating)
    # the prefill side of a mixed batch (never on the patched path): deterministic stand-ins
    monkeypatch.setattr(gdn, "causal_conv1d_fn", lambda x, *args, **kwargs: (x.float() * 0.5 + 0.25).to(x.dtype))
    monkeypatch.setattr(gdn, "fused_post_conv_prep", post_conv_prep)
    return calls


def post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, **kwargs):
    q, k, v = conv_output.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
    n = conv_output.shape[0]
    return (q.reshape(n, -1, head_k_dim), k.reshape(n, -1, head_k_dim), v.reshape(n, -1, head_v_dim),
            a.float() - A_log, b.float().sigmoid())


def chunk_rule(q, k, v, g, beta, initial_state, **kwargs):
    out = v * beta[..., None].to(v.dtype) + g[..., None].to(v.dtype)
    return out, initial_state.float() * 0.5 + 1.0


class Layer:
    """The attributes of QwenGatedDeltaNetAttention that ``_forward_core`` reads, and its own rearrange."""

    def __init__(self, gdn, gen: torch.Generator, num_blocks: int, num_spec: int, state_dtype: torch.dtype):
        self.prefix = PREFIX
        self.enable_packed_recurrent_decode = False
        self.key_dim, self.value_dim, self.tp_size = KEY_DIM, VALUE_DIM, 1
        self.num_k_heads, self.head_k_dim, self.head_v_dim = HK, DK, DV
        self.activation = "silu"
        self.conv1d = SimpleNamespace(weight=(0.3 * torch.randn(CONV_DIM, 1, WIDTH, generator=gen)).to(DTYPE),
                                      bias=(0.1 * torch.randn(CONV_DIM, generator=gen)).to(DTYPE))
        self.A_log = 0.5 * torch.randn(HV, generator=gen)
        self.dt_bias = 0.5 * torch.randn(HV, generator=gen)
        state_len = WIDTH - 1 + num_spec
        conv_shape = (num_blocks, CONV_DIM, state_len) if gdn.is_conv_state_dim_first() else (
            num_blocks, state_len, CONV_DIM)
        self.kv_cache = [(0.5 * torch.randn(conv_shape, generator=gen)).to(DTYPE),
                         0.1 * torch.randn(num_blocks, HV, DV, DK, generator=gen).to(state_dtype)]
        self.chunk_gated_delta_rule = chunk_rule
        self.rearrange_mixed_qkv = types.MethodType(gdn.QwenGatedDeltaNetAttention.rearrange_mixed_qkv, self)

    def clone(self) -> Layer:
        other = object.__new__(Layer)
        other.__dict__.update(self.__dict__)
        other.kv_cache = [t.clone() for t in self.kv_cache]
        other.rearrange_mixed_qkv = types.MethodType(self.rearrange_mixed_qkv.__func__, other)
        return other


def builder(num_spec: int, full_graphs: bool):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    config = builder_config(num_spec, full_graphs, "none", MAX_NUM_SEQS)
    spec = MambaSpec(block_size=64, shapes=((2, 3), (2, 4)), dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode="none", num_speculative_blocks=num_spec)
    return GDNAttentionMetadataBuilder(spec, [PREFIX], config, torch.device("cpu"))


def metadata(num_spec: int, query_lens: list[int], drafts: list[int] | None, accepted: list[int] | None,
             pad_tokens: int = 0, full_graphs: bool = True):
    """The real builder's metadata for one step; rows with query length 0 are CUDA-graph padding, and
    ``pad_tokens`` more tokens are the graph's token padding (num_actual_tokens counts them)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    width = 1 + num_spec
    table = torch.arange(1, 1 + len(query_lens) * width, dtype=torch.int32).view(-1, width)
    table[[q == 0 for q in query_lens]] = 0
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens = [13 + 7 * i + q if q else 0 for i, q in enumerate(query_lens)]
    num_tokens = int(qsl[-1]) + pad_tokens
    common = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=torch.arange(num_tokens))
    spec_args = {} if drafts is None else {
        "num_accepted_tokens": torch.tensor(accepted, dtype=torch.int32),
        "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32)}
    return builder(num_spec, full_graphs).build(0, common, **spec_args), int(table.max()) + 1


def inputs(gen: torch.Generator, num_tokens: int):
    """The custom op's inputs as forward_cuda passes them: qkv a column slice of the qkvz projection (strided),
    b and a contiguous, core_attn_out zeros."""
    qkvz = (0.5 * torch.randn(num_tokens, CONV_DIM + VALUE_DIM, generator=gen)).to(DTYPE)
    b = torch.randn(num_tokens, HV, generator=gen).to(DTYPE)
    a = torch.randn(num_tokens, HV, generator=gen).to(DTYPE)
    return qkvz, b, a, torch.zeros(num_tokens, HV, DV, dtype=DTYPE)


def run_both(gdn, vllm_forward_core, monkeypatch, md, num_blocks, num_spec, seed=0,
             state_dtype=torch.float16, extra_rows=0):
    """(vLLM's layer and output, the patched layer and output), from the same layer and inputs."""
    gen = torch.Generator().manual_seed(seed)
    layer = Layer(gdn, gen, num_blocks, num_spec, state_dtype)
    qkvz, b, a, out = inputs(gen, md.num_actual_tokens + extra_rows)
    monkeypatch.setattr(gdn, "get_forward_context", lambda: SimpleNamespace(attn_metadata={PREFIX: md}))
    results = []
    for forward_core in (vllm_forward_core, gdn.QwenGatedDeltaNetAttention._forward_core):
        run_layer, run_qkvz, run_out = layer.clone(), qkvz.clone(), out.clone()
        forward_core(run_layer, run_qkvz[:, :CONV_DIM], b.clone(), a.clone(), run_out)
        results.append((run_layer, run_out, run_qkvz))
    return results


def spec_case(batch: int, k: int, seed: int, pad_rows: int = 0, pad_tokens: int = 0):
    gen = torch.Generator().manual_seed(100 * batch + k + seed)
    accepted = torch.randint(1, k + 2, (batch,), generator=gen).tolist()
    return metadata(k, [k + 1] * batch + [0] * pad_rows, [k] * batch + [-1] * pad_rows,
                    accepted + [1] * pad_rows, pad_tokens)


def assert_same_states(vllm_layer, ours_layer):
    for want, got in zip(vllm_layer.kv_cache, ours_layer.kv_cache, strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("batch", range(1, 5))
def test_all_spec_batches_are_bit_identical(gdn, vllm_forward_core, kernels, monkeypatch, batch, k):
    md, num_blocks = spec_case(batch, k, seed=0)
    assert md.num_prefills == 0 and md.num_decodes == 0 and md.spec_sequence_masks is not None
    (vllm_layer, want, want_qkvz), (ours_layer, got, got_qkvz) = run_both(
        gdn, vllm_forward_core, monkeypatch, md, num_blocks, k, seed=batch * 10 + k)
    assert want.isfinite().all() and want.abs().sum() > 0
    assert torch.equal(want, got)
    assert torch.equal(want_qkvz, got_qkvz)  # the conv's in-place output, the same call on both sides
    assert_same_states(vllm_layer, ours_layer)
    assert "out" not in kernels[0] and "out" in kernels[1]  # vLLM's code, then the patched path


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("batch,k,pad_rows,pad_tokens", [(1, 4, 1, 3), (2, 3, 2, 0), (3, 7, 1, 5)])
def test_cuda_graph_padded_batches(gdn, vllm_forward_core, kernels, monkeypatch, batch, k, pad_rows, pad_tokens,
                                   state_dtype):
    """Padded request rows and padded tokens (FULL CUDA graphs): the rows the kernel writes are vLLM's; the rows
    it skips keep core_attn_out's zeros (vLLM copies its new_empty's uninitialised rows there)."""
    md, num_blocks = spec_case(batch, k, seed=1, pad_rows=pad_rows, pad_tokens=pad_tokens)
    real = batch * (k + 1)
    (vllm_layer, want, want_qkvz), (ours_layer, got, got_qkvz) = run_both(
        gdn, vllm_forward_core, monkeypatch, md, num_blocks, k, seed=7, state_dtype=state_dtype, extra_rows=2)
    assert md.num_actual_tokens == real + pad_tokens and "out" in kernels[1]
    assert torch.equal(want[:real], got[:real])
    assert not got[real:].any()  # padded tokens and the rows past num_actual_tokens
    assert torch.equal(want_qkvz, got_qkvz)
    assert_same_states(vllm_layer, ours_layer)


OTHER_BATCHES = {
    # name: (num_spec, query_lens, drafts, accepted)
    "spec decodes beside prefills": (4, [5, 5, 1, 8], [4, 4, -1, -1], [2, 5, 1, 1]),
    "spec decode beside a prefill, k=2": (2, [3, 6], [2, -1], [3, 1]),
    "plain decode on a speculative engine": (4, [1, 1], [-1, -1], [1, 1]),
    "plain decode": (0, [1, 1, 1], None, None),
}


@pytest.mark.parametrize("name", OTHER_BATCHES)
def test_other_batches_take_vllms_code(gdn, vllm_forward_core, kernels, monkeypatch, name):
    num_spec, query_lens, drafts, accepted = OTHER_BATCHES[name]
    md, num_blocks = metadata(num_spec, query_lens, drafts, accepted)
    assert md.num_prefills > 0 or md.num_decodes > 0
    (vllm_layer, want, want_qkvz), (ours_layer, got, got_qkvz) = run_both(
        gdn, vllm_forward_core, monkeypatch, md, num_blocks, num_spec, seed=3)
    assert want.isfinite().all() and torch.equal(want, got) and torch.equal(want_qkvz, got_qkvz)
    assert_same_states(vllm_layer, ours_layer)
    assert kernels and all("out" not in call for call in kernels)


def test_a_dtype_other_than_the_kernels_takes_vllms_code(gdn, kernels):
    md, _ = spec_case(1, 4, seed=0)
    qkvz, b, a, out = inputs(torch.Generator().manual_seed(0), md.num_actual_tokens)
    assert not gdn_verify_copies.forward_spec_only(None, qkvz[:, :CONV_DIM], b, a, out.double(), md)
    assert not kernels


def test_the_patched_path_runs_two_copies_where_vllm_runs_five(gdn, vllm_forward_core, kernels, monkeypatch):
    """vLLM: three reshape copies (clone), the cat and the output copy; patched: two copy_, and otherwise only
    views and one allocation: no op that reads a value to the host or sizes a tensor by data (CUDA graphs)."""
    md, num_blocks = spec_case(1, 4, seed=0)
    gen = torch.Generator().manual_seed(0)
    layer = Layer(gdn, gen, num_blocks, 4, torch.float16)
    monkeypatch.setattr(gdn, "get_forward_context", lambda: SimpleNamespace(attn_metadata={PREFIX: md}))
    recorded = []
    for forward_core in (vllm_forward_core, gdn.QwenGatedDeltaNetAttention._forward_core):
        run_layer, (qkvz, b, a, out) = layer.clone(), inputs(gen, md.num_actual_tokens)
        with RecordOps() as ops:
            forward_core(run_layer, qkvz[:, :CONV_DIM], b, a, out)
        recorded.append(ops.ops)
    vllm_ops, ours = recorded
    assert sorted(op for op in vllm_ops if op in COPY_OPS) == ["cat", "clone", "clone", "clone", "copy_"]
    assert sorted(op for op in ours if op in COPY_OPS) == ["copy_", "copy_"]
    assert set(ours) <= {"slice", "select", "view", "split_with_sizes", "transpose", "new_empty", "copy_"}, ours


@pytest.mark.parametrize("tokens", [1, 2, 5, 12])
@pytest.mark.parametrize("layout", ["qkvz slice", "contiguous", "transposed"])
def test_planar_qkv_is_rearrange_mixed_qkv(gdn, tokens, layout):
    """The same values, shapes and strides, and the same buffer layout (k's rows after q's, v's after k's)."""
    gen = torch.Generator().manual_seed(tokens)
    layer = SimpleNamespace(key_dim=KEY_DIM, value_dim=VALUE_DIM, tp_size=1, head_k_dim=DK, head_v_dim=DV)
    if layout == "qkvz slice":
        mixed = torch.randn(tokens, CONV_DIM + VALUE_DIM, generator=gen).bfloat16()[:, :CONV_DIM]
    elif layout == "contiguous":
        mixed = torch.randn(tokens, CONV_DIM, generator=gen).bfloat16()
    else:
        mixed = torch.randn(CONV_DIM, tokens, generator=gen).bfloat16().t()
    want = gdn.QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, mixed)
    got = gdn_verify_copies.planar_qkv(layer, mixed)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g) and w.shape == g.shape and w.stride() == g.stride() and g.is_contiguous()
    assert [t.data_ptr() - want[0].data_ptr() for t in want] == [t.data_ptr() - got[0].data_ptr() for t in got]
    assert got[0].untyped_storage().data_ptr() != mixed.untyped_storage().data_ptr()


def test_planar_qkv_under_tensor_parallel_shards(gdn):
    layer = SimpleNamespace(key_dim=2 * KEY_DIM, value_dim=2 * VALUE_DIM, tp_size=2, head_k_dim=DK, head_v_dim=DV)
    mixed = torch.randn(6, CONV_DIM + VALUE_DIM).bfloat16()[:, :CONV_DIM]
    want = gdn.QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, mixed)
    assert all(torch.equal(w, g) for w, g in zip(want, gdn_verify_copies.planar_qkv(layer, mixed), strict=True))


def test_the_recurrent_kernel_writes_into_out(gdn):
    """``out``: the values the kernel's own buffer gets, in the caller's buffer; a view of it comes back."""
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating_delta_rule_update as rule

    gen = torch.Generator().manual_seed(5)
    tokens = 6
    q, k = (torch.randn(1, tokens, HK, DK, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, tokens, HV, DV, generator=gen).bfloat16()
    a, b = (torch.randn(tokens, HV, generator=gen).bfloat16() for _ in range(2))
    state = 0.1 * torch.randn(9, HV, DV, DK, generator=gen)
    args = dict(A_log=torch.randn(HV, generator=gen), a=a, b=b, dt_bias=torch.randn(HV, generator=gen), q=q, k=k,
                v=v, inplace_final_state=True, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor([2, 3], dtype=torch.int32), use_qk_l2norm_in_kernel=True)
    want, want_state = rule(initial_state=state.clone(), **args)
    out = torch.zeros(tokens, HV, DV, dtype=torch.bfloat16)
    got, got_state = rule(initial_state=state.clone(), out=out, **args)
    assert torch.equal(want, got) and torch.equal(want.squeeze(0), out) and torch.equal(want_state, got_state)
    assert got.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="contiguous, in q's dtype"):
        rule(initial_state=state.clone(), out=out.float(), **args)
    with pytest.raises(ValueError, match="contiguous, in q's dtype"):
        rule(initial_state=state.clone(), out=torch.zeros(HV, tokens, DV, dtype=torch.bfloat16).transpose(0, 1),
             **args)


def test_the_patch_hooks_the_core_and_leaves_the_rest(pristine_vllm):
    patched = (Path(os.environ["QS_PATCHED_VLLM"]) / LAYER_FILE).read_text()
    pristine = (pristine_vllm / LAYER_FILE).read_text()
    assert "forward_spec_only(self, mixed_qkv, b, a, core_attn_out, attn_metadata)" in patched
    assert "gdn_verify_copies" not in pristine
    # the hook is all the patch adds to the layer, and it removes nothing: vLLM's code serves every other batch
    diff = [line for line in difflib.ndiff(pristine.splitlines(), patched.splitlines()) if line[:1] in "+-"]
    assert all(line.startswith("+ ") for line in diff) and len(diff) == 7, diff
