"""Shared memory a Triton kernel needs per block on a given NVIDIA architecture, compiled without a GPU.

Triton lowers TTIR -> TTGIR -> LLVM IR for any ``GPUTarget``; its shared-memory allocation pass runs before the
LLVM IR is emitted and records the block's bytes (``metadata["shared"]``, what the launcher requests as
dynamic shared memory). Stopping there skips ptxas, which adds nothing to that figure. Needs the real Triton
compiler: run it in a process without TRITON_INTERPRET (tests/test_spec_attn_smem.py does).

    python -m tests.helpers.triton_smem CAPABILITY   # the verify kernel at every block length, as JSON
"""

from __future__ import annotations

import json
import os
import sys


def shared_bytes(kernel, signature: dict, constexprs: dict, capability: int, num_warps: int, num_stages: int) -> int:
    from triton._C.libtriton import ir
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    backend = backends["nvidia"].compiler(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    metadata: dict = {}
    for name in ("ttir", "ttgir", "llir"):
        module = stages[name](module, metadata)
    return int(metadata["shared"])


def verify_kernel_shared(capability: int) -> dict[int, dict]:
    """The split-KV verify kernel at the serving geometry, for every verify length the routing hands it."""
    from qwen_serving import model
    from qwen_serving.engine.attn_routing import MAX_VERIFY_QUERY
    from qwen_serving.engine.kernels import spec_attn

    kernel = spec_attn.split_kv_kernel
    group = model.Q_HEADS // model.KV_HEADS
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "block_table_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                "sm_scale": "fp32"}
    compiled: dict = {}
    result = {}
    for query_len in range(1, MAX_VERIFY_QUERY + 1):
        tile = spec_attn.tiles(query_len, group)
        if tile not in compiled:
            constexprs = {"GROUP": group, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "D": model.HEAD_DIM,
                          "UPCAST_DOT": False}
            signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                         for name in kernel.arg_names}
            compiled[tile] = shared_bytes(kernel, signature, constexprs, capability, tile.num_warps,
                                          tile.num_stages)
        result[query_len] = {"block_m": tile.block_m, "block_n": tile.block_n, "shared": compiled[tile]}
    return result


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("TRITON_INTERPRET=1 replaces the compiler: unset it")
    print(json.dumps(verify_kernel_shared(int(sys.argv[1]))))
