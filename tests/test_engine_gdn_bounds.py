"""vLLM PR #50021's bug class: GDN speculative-decode kernels indexing outside a request's state row.

Each vLLM copy (pristine, patched) runs tests/helpers/gdn_spec_probe.py in its own subprocess under the Triton
interpreter, since the pristine kernels can segfault it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving.engine.gdn_spec_bounds import accepted_slot
from tests.helpers.engine_trees import ENV, load, tree

PROBE = Path(__file__).parent / "helpers" / "gdn_spec_probe.py"


def _probe(name: str, *probes: str) -> tuple[int, dict[str, dict]]:
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(tree(name).parent), *probes],
        capture_output=True, text=True, timeout=600,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record.pop("probe")] = record
    return proc.returncode, results


@pytest.fixture(scope="module")
def patched() -> dict[str, dict]:
    rc, results = _probe("patched", "cross:recurrent", "cross:sigmoid", "far:recurrent", "far:sigmoid")
    assert rc == 0, f"patched kernels crashed the interpreter (rc {rc})"
    return results


@pytest.fixture(scope="module")
def pristine_cross() -> dict[str, dict]:
    rc, results = _probe("pristine", "cross:recurrent", "cross:sigmoid")
    assert rc == 0, rc
    return results


@pytest.mark.parametrize("kernel", ["recurrent", "sigmoid"])
def test_pristine_reads_another_rows_state(pristine_cross, kernel):
    # counts 7 and 0 make the stock kernels take their initial state from outside the request's row
    assert pristine_cross[f"cross:{kernel}"]["matches_clamped"] == [False, False]


@pytest.mark.parametrize("probe", ["cross:recurrent", "cross:sigmoid", "far:recurrent", "far:sigmoid"])
def test_patched_stays_in_row(patched, probe):
    assert patched[probe]["matches_clamped"] == [True, True]


def test_in_range_counts_unchanged(patched, pristine_cross):
    for kernel in ("recurrent", "sigmoid"):
        probe = f"cross:{kernel}"
        assert patched[probe]["in_range_digest"] == pristine_cross[probe]["in_range_digest"]


def test_pristine_past_the_tensor_crashes_or_misreads():
    # a count of 7 on the last row reads past the end of the index tensor: a segfault, or garbage
    rc, results = _probe("pristine", "far:sigmoid")
    if rc == 0:
        assert results["far:sigmoid"]["matches_clamped"][1] is False
    else:
        assert rc in (-signal.SIGSEGV, 128 + signal.SIGSEGV, -signal.SIGBUS), rc


@pytest.mark.parametrize(("accepted", "slots", "slot"), [(1, 3, 0), (3, 3, 2), (0, 3, 0), (7, 3, 2), (-4, 1, 0)])
def test_accepted_slot(accepted, slots, slot):
    assert accepted_slot(accepted, slots) == slot


def test_accepted_slot_needs_a_row():
    with pytest.raises(ValueError, match="at least one slot"):
        accepted_slot(1, 0)



def test_align_copy_specs_stay_in_bounds():
    import torch

    specs = {name: load(name, "model_executor/layers/mamba/mamba_utils.py") for name in ENV}
    conv = torch.arange(4 * 5 * 2, dtype=torch.float32).view(4, 5, 2)  # SD layout: blocks, state_len, dim
    temporal = torch.zeros(8, 3)
    block_ids = [4, 5, 6]
    # a count of 0: stock slices conv[b, -1:] (only the last row) and takes block_ids[-1] (another block)
    stock = specs["pristine"]
    assert stock.get_conv_copy_spec(conv, [1], 0, 0).num_elements == 2
    assert stock.get_temporal_copy_spec(temporal, block_ids, 0, 0).start_addr == temporal[6].data_ptr()
    with pytest.raises(IndexError):
        stock.get_temporal_copy_spec(temporal, block_ids, 1, 5)
    fixed = specs["patched"]
    assert fixed.get_conv_copy_spec(conv, [1], 0, 0).num_elements == 5 * 2
    assert fixed.get_conv_copy_spec(conv, [1], 0, 9).start_addr == conv[1, 4].data_ptr()
    assert fixed.get_temporal_copy_spec(temporal, block_ids, 0, 0).start_addr == temporal[4].data_ptr()
    assert fixed.get_temporal_copy_spec(temporal, block_ids, 1, 5).start_addr == temporal[6].data_ptr()
    # in range, both agree
    for module in specs.values():
        assert module.get_conv_copy_spec(conv, [1], 0, 3).start_addr == conv[1, 2].data_ptr()
        assert module.get_temporal_copy_spec(temporal, block_ids, 0, 2).start_addr == temporal[5].data_ptr()


def test_align_block_table_window_stays_in_row():
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    utils = {name: load(name, "v1/attention/backends/utils.py") for name in ENV}
    spec = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=(torch.float32,), num_speculative_blocks=2)
    table = torch.arange(2 * 6, dtype=torch.int32).view(2, 6)  # cdiv(16, 4) + 2 columns per request
    seq_lens = torch.tensor([16, 40])  # the second one is a padded/stale entry past the row
    with pytest.raises(RuntimeError, match="out of bounds"):
        utils["pristine"].mamba_get_block_table_tensor(table, seq_lens.clone(), spec, "align")
    window = utils["patched"].mamba_get_block_table_tensor(table, seq_lens.clone(), spec, "align")
    assert window.tolist() == [[3, 4, 5], [9, 10, 11]]
