"""Run vLLM's GDN speculative-decode kernels under the Triton interpreter with bad accepted counts.

Run by tests/test_engine_gdn_bounds.py, one subprocess per vLLM copy and case, because an
out-of-bounds read can take the interpreter process down (SIGSEGV).

    python tests/helpers/gdn_spec_probe.py VLLM_PARENT_DIR {cross,far}:{recurrent,sigmoid} ...

Prints one JSON line per probe: for every request, whether its output equals the one computed from
the slot a bounds-checked kernel must use (the clamped ``num_accepted_tokens - 1``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

tl = None  # triton.language, bound once the CPU shims are installed
N, T, H, HV, K, V = 2, 3, 2, 2, 16, 16  # 2 requests x (1 + 2 drafts)
POISON = 7  # state line holding another request's (here: huge) state
NUM_LINES = 8


def main() -> None:
    vllm_parent = sys.argv[1]
    sys.path[:0] = [vllm_parent, str(REPO)]
    from qwen_serving.engine import cpu_compat

    cpu_compat.install()
    import vllm

    assert Path(vllm.__file__).parent.parent == Path(vllm_parent).resolve(), vllm.__file__
    for probe in sys.argv[2:]:
        case, kernel = probe.split(":")
        result = _probe(case, _recurrent() if kernel == "recurrent" else _sigmoid())
        print(json.dumps({"probe": probe, **result}), flush=True)


def _probe(case: str, run) -> dict:
    import torch

    torch.manual_seed(0)
    inputs = {name: torch.randn(1, N * T, *shape) for name, shape in
              (("q", (H, K)), ("k", (H, K)), ("v", (HV, V)), ("a", (HV,)), ("b", (HV,)))}
    inputs["k"] *= 0.3
    state = torch.randn(NUM_LINES, HV, V, K)
    state[POISON] = 1e4
    cu = torch.tensor([0, T, 2 * T], dtype=torch.int32)
    if case == "cross":
        # each row is a view into a wider table whose extra columns point at the poisoned line:
        # counts [7, 0] index columns 6 and -1 (= the previous row's last column)
        wide = torch.full((N, 8), POISON, dtype=torch.int32)
        wide[:, :T] = torch.arange(1, 1 + N * T, dtype=torch.int32).view(N, T)
        slots, bad, clamped = wide[:, :T], [7, 0], [T, 1]
    else:
        # contiguous rows; count 7 of the last row reads 4 entries past the end of the tensor
        slots, bad, clamped = torch.arange(1, 1 + N * T, dtype=torch.int32).view(N, T), [2, 7], [2, T]

    def outputs(accepted: list[int]) -> torch.Tensor:
        return run(inputs, state.clone(), cu, slots, torch.tensor(accepted, dtype=torch.int32))

    expected = outputs(clamped)
    got = outputs(bad)
    rows = got.view(N, T, HV, V)
    same = [bool(torch.equal(rows[n], expected.view(N, T, HV, V)[n])) for n in range(N)]
    # outputs for in-range counts, to check the bounds checks change nothing there
    digest = hashlib.sha256(expected.numpy().tobytes()).hexdigest()[:16]
    return {"matches_clamped": same, "in_range_digest": digest}


def _recurrent():
    global tl  # a jitted helper finds `tl` among its module's globals
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent as fr
    from vllm.triton_utils import tl, triton

    @triton.jit
    def _exp(x):
        return tl.exp(x)

    fr.exp = _exp  # the interpreter cannot call the module-level alias `exp = tl.exp`

    def run(x, state, cu, slots, accepted):
        g = -torch_sigmoid(x["a"])
        o, _ = fr.fused_recurrent_gated_delta_rule_fwd(
            x["q"], x["k"], x["v"], g, torch_sigmoid(x["b"]), K**-0.5, state, True, cu, slots, accepted, True
        )
        return o

    return run


def _sigmoid():
    import torch
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    a_log, dt_bias = torch.linspace(-1, 0, HV), torch.zeros(HV)

    def run(x, state, cu, slots, accepted):
        o, _ = fused_sigmoid_gating_delta_rule_update(
            a_log, x["a"], x["b"], dt_bias, x["q"], x["k"], x["v"], initial_state=state,
            inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots,
            num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
        )
        return o

    return run


def torch_sigmoid(x):
    import torch

    return torch.sigmoid(x)


if __name__ == "__main__":
    main()
