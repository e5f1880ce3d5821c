"""engine/vision_offload.py and patches/vision-offload.patch (VISION_OFFLOAD=1, issue #23 item 2), on the CPU.

A small tower built from vLLM 0.28.0's own Qwen3_VisionTransformer (tests/helpers/vision_tower.py) encodes one
image bit-identically with and without offload at several budgets. On the CPU the device and the host are the
same memory, so a weight's place is told by its storage: the offload moves each streamed weight into a new
(host) storage, and a weight is on the device while it sits in any other storage than that one (a staged copy),
or when it was never moved (what stays and what the budget keeps). Those bytes, summed at every leaf module's
forward, stay within the budget. The real tower's shapes (on the meta device) give the launcher's default and
floor. Last, the tiny checkpoint goes through the patched BaseModelLoader.load_model in a subprocess.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_serving import knobs, model
from qwen_serving.checkpoint import synth
from qwen_serving.engine import vision_offload
from tests.helpers import vision_tower
from tests.helpers.tiny_checkpoint import REPO, make_tiny

GiB = 1 << 30
GRID = (1, 4, 6)  # 24 patches, 6 merged rows


def weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return list({id(t): (name, t) for name, t in named}.values())


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Residency:
    """Where each of a tower's weights is, by storage, and the bytes on the device at every leaf forward."""

    def __init__(self, tower: torch.nn.Module, loaded: dict[str, int]):
        self.tower = tower
        self.host = {name: storage(t) for name, t in weights(tower)}  # after offload
        self.moved = {name for name in self.host if self.host[name] != loaded[name]}
        self.samples: list[tuple[str, int, set[str]]] = []  # (leaf, bytes on the device, units staged)
        self.units = [name for name, _ in vision_offload.units(tower)]
        uses = collections.Counter(id(m) for _, m in tower.named_modules(remove_duplicate=False))
        for name, leaf in tower.named_modules():
            if not list(leaf.children()) and uses[id(leaf)] == 1:  # a shared one (the MLPs' act_fn) has no one name
                leaf.register_forward_pre_hook(lambda m, args, name=name: self.samples.append((name, *self.now())))

    def now(self) -> tuple[int, set[str]]:
        on_device, staged = 0, set()
        for name, t in weights(self.tower):
            if name not in self.moved:
                on_device += nbytes(t)
            elif storage(t) != self.host[name]:
                on_device += nbytes(t)
                staged.add(next(unit for unit in self.units if name.startswith(unit + ".")))
        return on_device, staged


def loaded_storages(tower: torch.nn.Module) -> dict[str, int]:
    return {name: storage(t) for name, t in weights(tower)}


def unit_names(tower: torch.nn.Module, units: set[str]) -> set[str]:
    return {name for name, _ in weights(tower) if any(name.startswith(unit + ".") for unit in units)}


@pytest.fixture(scope="module")
def reference(vllm_world):
    tower = vision_tower.build(vision_tower.SMALL)
    pixels = vision_tower.patches(tower, GRID)
    return pixels, vision_tower.encode(tower, pixels, GRID)


def small_sizes() -> tuple[int, int, int]:
    """(fixed bytes, a block's buffer, the merger's buffer) of the small tower, from its shapes."""
    tower = vision_tower.build(vision_tower.SMALL, device="meta", seed=None)
    named = dict(vision_offload.units(tower))
    return (vision_offload.fixed_bytes(tower), vision_offload.unit_bytes(named["blocks.0"]),
            vision_offload.unit_bytes(named["merger"]))


# budget (from fixed, block, merger) -> the units it keeps on the device
BUDGETS = {
    "floor: everything streams": (lambda f, b, m: f + m, ()),
    "the merger stays": (lambda f, b, m: f + m + b, ("merger",)),
    "the merger and two blocks stay": (lambda f, b, m: f + m + 3 * b, ("blocks.0", "blocks.1", "merger")),
    "the whole tower stays": (lambda f, b, m: f + m + 4 * b, ("blocks.0", "blocks.1", "blocks.2", "blocks.3", "merger")),
}


@pytest.mark.parametrize("case", BUDGETS)
def test_offloaded_encode_is_bit_exact_and_within_the_budget(vllm_world, reference, case):
    pixels, expected = reference
    rule, kept = BUDGETS[case]
    budget = rule(*small_sizes())
    tower = vision_tower.build(vision_tower.SMALL)
    loaded = loaded_storages(tower)
    done = vision_offload.offload(tower, budget)
    residency = Residency(tower, loaded)
    streamed = {name for name, _ in vision_offload.units(tower)} - set(kept)
    assert done.kept == kept and set(done.streamed) == streamed
    assert residency.moved == unit_names(tower, streamed)  # off the device until their forward: nothing else moved
    got = vision_tower.encode(tower, pixels, GRID)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert residency.samples and max(b for _, b, _ in residency.samples) <= budget
    for leaf, _, staged in residency.samples:  # one unit at a time: the one running
        assert staged == {unit for unit in streamed if leaf.startswith(unit + ".")}, (leaf, staged)
    assert {unit for _, _, staged in residency.samples for unit in staged} == streamed
    on_device, staged = residency.now()
    assert staged == set() and on_device <= done.fixed_bytes + done.kept_bytes  # all back in host RAM after the encode
    assert done.peak_bytes <= budget


def test_a_budget_below_the_floor_is_refused(vllm_world):
    fixed, block, merger = small_sizes()
    tower = vision_tower.build(vision_tower.SMALL)
    loaded = loaded_storages(tower)
    with pytest.raises(ValueError, match=r"VLLM_VISION_OFFLOAD_GIB=.* is below what the vision tower needs .* "
                                         r"raise it to at least"):
        vision_offload.offload(tower, fixed + merger - 1)
    assert loaded_storages(tower) == loaded  # refused before anything moved


def test_a_failing_forward_still_drops_the_staged_copy(vllm_world, reference):
    pixels, _ = reference
    tower = vision_tower.build(vision_tower.SMALL)
    loaded = loaded_storages(tower)
    fixed, _, merger = small_sizes()
    vision_offload.offload(tower, fixed + merger)  # the floor: every unit streams
    residency = Residency(tower, loaded)

    def fail(module, args):
        raise RuntimeError("inside blocks.1")

    tower.blocks[1].mlp.linear_fc2.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside blocks.1"):
        vision_tower.encode(tower, pixels, GRID)
    assert residency.samples[-1][2] == {"blocks.1"}  # it was staged when the forward failed
    assert residency.now()[1] == set()


def test_choose_kept_largest_first_beside_one_slot():
    fixed, sizes = 9, [30, 30, 30, 90]  # three blocks and a merger
    assert vision_offload.choose_kept(sizes, fixed, 99) == set()  # 9 + 90: the merger streams through the slot
    assert vision_offload.choose_kept(sizes, fixed, 128) == set()  # the merger would need 9 + 90 + a 30 slot
    assert vision_offload.choose_kept(sizes, fixed, 129) == {3}
    assert vision_offload.choose_kept(sizes, fixed, 159) == {0, 3}
    assert vision_offload.choose_kept(sizes, fixed, 189) == {0, 1, 2, 3}  # the last one kept needs no slot
    with pytest.raises(ValueError, match="at least"):
        vision_offload.choose_kept(sizes, fixed, 98)


def test_the_real_towers_default_budget_and_floor(vllm_world):
    tower = vision_tower.build(model.VISION_CONFIG, device="meta", seed=None)
    named = vision_offload.units(tower)
    sizes = [vision_offload.unit_bytes(unit) for _, unit in named]
    fixed = vision_offload.fixed_bytes(tower)
    assert sum(nbytes(t) for _, t in weights(tower) if isinstance(t, torch.nn.Parameter)) == model.vision_tower_bytes()
    assert fixed + max(sizes) == model.vision_offload_floor_bytes()  # what the launcher's floor is computed from
    kept = vision_offload.choose_kept(sizes, fixed, int(knobs.VISION_OFFLOAD_GIB * GiB))
    assert [named[i][0] for i in kept] == ["merger"]  # the default: every block streams (module docstring)
    assert round(sum(s for i, s in enumerate(sizes) if i not in kept) / GiB, 2) == 0.77
    vision_offload.choose_kept(sizes, fixed, int(knobs.VISION_OFFLOAD_MIN_GIB * GiB))
    with pytest.raises(ValueError, match=f"at least {knobs.VISION_OFFLOAD_MIN_GIB:g} "):
        vision_offload.choose_kept(sizes, fixed, model.vision_offload_floor_bytes() - 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory)


def test_the_patched_loader_offloads_the_tower_after_processing(tiny):
    patched = os.environ.get("QS_PATCHED_VLLM")
    loader = Path(patched or ".") / "model_executor" / "model_loader" / "base_loader.py"
    if not patched or "vision_offload" not in loader.read_text():
        pytest.skip("needs the patched vLLM tree (bash tests/run.sh)")
    floor = model.vision_offload_floor_bytes(synth.TINY.vision)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "vision_offload_load.py"), str(tiny),
                           repr(floor / GiB)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    units = [f"blocks.{i}" for i in range(synth.TINY.vision["depth"])] + ["merger"]
    assert result["off"]["moved"] == []
    assert result["on"]["moved"] == units  # after process_weights_after_loading; the tiny floor: every module streams
    assert result["on"]["pinned"] is False  # no CUDA here: pageable host buffers
    assert result["bit_exact"] and result["shape"][1] == synth.TINY.vision["out_hidden_size"]
