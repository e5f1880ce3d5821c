"""TP (tensor parallelism) as a knob: which card counts the model splits across, what each card holds (checked
against vLLM 0.28.0's own state-shape, page and Marlin shape code), the argv through vLLM's parser for both
modes and every CTX/SPEC pairing, the refusals with their reasons, and KV_MEM=auto over cards that differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_serving import knobs, memory, model, plan, preflight, vllm_028
from qwen_serving.memory import GiB, MiB
from qwen_serving.plan import PlanError, Probe
from tests.helpers.fake_gpu import fake_nvidia_smi

REPO = Path(__file__).resolve().parents[1]
KV_MEM = 5_583_457_484  # the spec's pinned 5.2 GiB pool


@pytest.fixture
def probe(tmp_path) -> Probe:
    drafter = tmp_path / knobs.DFLASH2_DRAFTER
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    return Probe(repo=tmp_path)


def refused(mode, env, probe, *needles) -> str:
    with pytest.raises(PlanError) as e:
        plan.build(mode, env, probe)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    return str(e.value)


# ---- what divides ----
def test_the_model_splits_across_1_2_and_4_cards_only():
    assert model.tp_sizes() == (1, 2, 4)
    assert model.tp_sizes(model.TP_SPLITS + model.DRAFTER_TP_SPLITS) == (1, 2, 4)
    three = model.tp_problems(3)
    assert "4 full-attention KV heads do not divide by 3" in three and "16 GDN key heads do not divide by 3" in three
    assert model.tp_problems(8) == ["4 full-attention KV heads do not divide by 8"]  # vLLM would replicate them


def test_tp_3_is_refused_before_boot_with_the_reason_and_the_fix(probe):
    for mode in knobs.MODES:
        msg = refused(mode, {"TP": "3"}, probe, "TP=3", "4 full-attention KV heads do not divide by 3",
                      "GDN key heads", "set TP=2 or TP=4")
        assert msg.count("do not divide") >= 2
    refused("single", {"TP": "8"}, probe, "4 full-attention KV heads do not divide by 8", "set TP=2 or TP=4")
    refused("single", {"TP": "0"}, probe, "TP='0'", "outside 1..8")


def test_the_cli_refuses_tp_3_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "qwen_serving.plan", "batch", "--dry-run"], capture_output=True,
                       text=True, cwd=REPO, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO),
                                                              "TP": "3"})
    assert r.returncode == 2 and not r.stdout and "KV heads do not divide by 3" in r.stderr and "TP=2" in r.stderr


@pytest.mark.parametrize("extra", ["--tensor-parallel-size 2", "--seed 1 --tensor-parallel-size=4", "-tp 2"])
def test_extra_args_carrying_the_tp_size_point_at_tp(extra, probe):
    refused("batch", {"EXTRA_ARGS": extra}, probe, "EXTRA_ARGS carries --tensor-parallel-size", "set TP=2")
    refused("single", {"EXTRA_ARGS": extra, "TP": "2"}, probe, "set TP=2")


# ---- each card's share, against vLLM's own arithmetic ----
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("k", [0, 4, 7])
def test_per_card_state_and_pages_are_vllms(tp, k):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, is_conv_state_dim_first
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, model.GDN_K_HEADS, model.GDN_V_HEADS, model.GDN_HEAD_DIM, model.GDN_HEAD_DIM, model.CONV_KERNEL, k)
    ours_conv, ours_ssm = model.gdn_state_shapes(k, tp)
    assert conv == (ours_conv[::-1] if is_conv_state_dim_first() else ours_conv) and ssm == ours_ssm
    shape = memory.CacheShape(spec="dflash2" if k == 7 else "mtp", spec_tokens=k, tp=tp)
    assert shape.block_size == memory.CacheShape(spec=shape.spec, spec_tokens=k).block_size  # both halve together
    state = MambaSpec(block_size=shape.block_size, shapes=(conv, ssm), dtypes=(torch.bfloat16, torch.float16))
    assert state.page_size_bytes == memory.gdn_state_bytes_per_layer("float16", k, tp=tp) <= shape.page_bytes
    full = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=model.KV_HEADS // tp, head_size=model.HEAD_DIM,
                             dtype=torch.bfloat16)
    assert full.page_size_bytes == shape.page_bytes
    window = SlidingWindowSpec(block_size=shape.block_size, num_kv_heads=model.DRAFTER_KV_HEADS // tp,
                               head_size=model.DRAFTER_HEAD_DIM, dtype=torch.bfloat16,
                               sliding_window=model.DRAFTER_WINDOW)
    assert window.page_size_bytes == shape.page_bytes  # the drafter's pages still line up with the target's


@pytest.mark.parametrize("tp", [2, 4])
def test_a_card_of_tp_holds_tp_times_the_blocks(tp):
    for one in (memory.CacheShape(spec="dflash2", spec_tokens=7, prefix_cache=True),
                memory.CacheShape(kv_dtype="fp8", prefix_cache=True), memory.CacheShape(spec="mtp", spec_tokens=4)):
        split = memory.CacheShape(**{**one.__dict__, "tp": tp})
        assert split.page_bytes * tp == one.page_bytes and split.groups == one.groups
        assert split.resident_bytes() * tp == one.resident_bytes()
        assert abs(split.num_blocks(KV_MEM) - tp * one.num_blocks(KV_MEM)) < tp
        assert split.longest_context(KV_MEM) >= tp * one.longest_context(KV_MEM) - tp * 1024


def test_weights_split_except_what_is_counted_whole():
    for spec in ("off", "mtp", "dflash2"):
        w = memory.weights(spec)
        assert memory.weights_bytes(spec) == w.total == w.per_card(1)
        assert memory.weights_bytes(spec, tp=2) == pytest.approx(w.split / 2 + w.whole)
    assert memory.weights("mtp").whole == 0 and memory.weights("dflash2").whole == memory.DFLASH2_DRAFTER_BYTES
    assert memory.weights("off", vision=True).whole == memory.VISION_TOWER_BYTES
    assert memory.weights_bytes("mtp", tp=4) < 4 * GiB  # 14.5 GiB of split weights, a quarter each
    assert model.padded_vocab(model.VOCAB) == model.VOCAB and model.VOCAB % (4 * model.MARLIN_MIN_N) == 0


def marlin_shapes(tp: int) -> dict[str, tuple[int, int, int]]:
    """(outputs, inputs, full inputs) on one card of every Marlin linear of the served model under TP: column-parallel
    ones split their outputs, row-parallel ones their inputs; the vocab-parallel heads split their padded rows."""
    q = model.Q_HEADS * model.HEAD_DIM
    kv = model.KV_HEADS * model.HEAD_DIM
    h, i = model.HIDDEN, model.INTERMEDIATE
    return {
        "qkv_proj": ((2 * q + 2 * kv) // tp, h, h), "o_proj": (h, q // tp, q),
        "gate_up_proj": (2 * i // tp, h, h), "down_proj": (h, i // tp, i),
        "in_proj_qkvz": ((model.CONV_DIM + model.GDN_VALUE_DIM) // tp, h, h),
        "out_proj": (h, model.GDN_VALUE_DIM // tp, model.GDN_VALUE_DIM),
        "mtp.fc": (h // tp, 2 * h, 2 * h), "lm_head": (model.padded_vocab(model.VOCAB) // tp, h, h),
    }


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_marlin_layer_fits_marlins_tiles_on_each_card(tp):
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        GPTQ_MARLIN_MIN_THREAD_K,
        GPTQ_MARLIN_MIN_THREAD_N,
        verify_marlin_supports_shape,
    )

    assert (model.MARLIN_MIN_N, model.MARLIN_MIN_K) == (GPTQ_MARLIN_MIN_THREAD_N, GPTQ_MARLIN_MIN_THREAD_K)
    for name, (out, inp, full) in marlin_shapes(tp).items():
        try:
            verify_marlin_supports_shape(out, inp, full, 128)
        except ValueError as e:
            raise AssertionError(f"{name} at TP={tp}: {e}") from None
    with pytest.raises(ValueError):  # what TP=3 would give the MLP
        verify_marlin_supports_shape(model.HIDDEN, model.INTERMEDIATE // 3, model.INTERMEDIATE, 128)


def test_the_40000_row_draft_head_misses_marlins_tile_under_tp():
    """The per-card finding behind the plan's draft-head rule: vLLM's own shape check on the head's rows."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import verify_marlin_supports_shape

    for rows, tp, fits in ((40_000, 1, True), (40_000, 2, False), (40_000, 4, False), (39_936, 2, True),
                           (39_936, 4, True)):
        per_card = model.padded_vocab(rows) // tp
        try:
            verify_marlin_supports_shape(per_card, model.HIDDEN, model.HIDDEN, 128)
            ok = True
        except ValueError:
            ok = False
        assert ok is fits is model.head_splits(rows, tp), (rows, tp)


# ---- the plan under TP: both modes, every CTX/SPEC pairing, through vLLM's own parser ----
COMBOS = [("batch", {"KV": kv}) for kv in ("fp8", "int4pth")] + \
    [("single", {"CTX": ctx, "SPEC": spec}) for ctx in ("fast", "long") for spec in ("mtp", "dflash2", "off")] + \
    [("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}), ("single", {"VISION": "1", "INT8_ACT": "int8"})]


@pytest.mark.parametrize("tp", ["2", "4"])
@pytest.mark.parametrize(("mode", "env"), COMBOS, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items())}"
                                                       for m, e in COMBOS])
def test_every_mode_and_pairing_plans_under_tp(tp, mode, env, probe, vllm_cli):
    one = plan.build(mode, env, probe)
    split = plan.build(mode, {**env, "TP": tp}, probe)
    assert "--tensor-parallel-size" not in one.argv
    _, ea = vllm_cli.serve(list(split.argv[1:]))
    assert ea.tensor_parallel_size == int(tp)
    without = list(split.argv)
    i = without.index("--tensor-parallel-size")
    del without[i:i + 2]
    assert tuple(without) == one.argv and split.env == one.env  # TP changes the argv by its flag alone
    derived = {d.name: d for d in split.derived}
    assert derived["cards"].value == int(tp) and "weights on GPU" not in derived
    weights = memory.weights_bytes(split.value("SPEC") if mode == "single" else "off", fast_variant=False,
                                   vision=bool(split.value("VISION")), tp=int(tp),
                                   vision_offload_gib=split.value("VISION_OFFLOAD_GIB") if split.value("VISION_OFFLOAD")
                                   else None)  # VISION=1 offloads the tower by default: its budget counts
    assert derived["weights per card"].value == f"{weights / GiB:.2f} GiB"
    if split.cache:
        assert split.cache.tp == int(tp) and derived["state page per resident"].value.endswith(" per card")


@pytest.mark.parametrize(("mode", "env", "needle"), [
    ("batch", {"KV": "kvarn"}, "'kvarn' is not one of fp8, int4pth"),
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "MAX_SEQS": "8"}, "set MAX_SEQS=4"),
])
def test_what_one_card_refuses_two_refuse_too(mode, env, needle, probe):
    refused(mode, {**env, "TP": "2"}, probe, needle)


def test_pinned_pool_holds_twice_the_tokens_on_two_cards(probe):
    one = plan.build("single", {"SPEC": "dflash2"}, probe)
    two = plan.build("single", {"SPEC": "dflash2", "TP": "2"}, probe)
    assert one.kv_mem == two.kv_mem == knobs.KV_MEM_PINNED  # --kv-cache-memory-bytes is per card
    assert two.cache.longest_context(two.kv_mem) > 2 * one.cache.longest_context(one.kv_mem) - 2048
    explain = "\n".join(plan.explain_lines(two, probe))
    assert "GiB per card / " in explain and "TP=2 on GPUs" in explain and "not checked yet" in explain
    assert "per card" not in "\n".join(plan.explain_lines(one, probe))


# ---- the draft head must split too ----
def served_with_head(probe: Probe, rows: int) -> None:
    fast = probe.repo / knobs.FAST_MODEL
    fast.mkdir(parents=True)
    (fast / "config.json").write_text(json.dumps({"draft_vocab": {"size": rows, "ids_file": "draft_vocab_ids.json"}}))


def test_a_head_that_does_not_split_falls_back_to_the_full_lm_head(probe):
    served_with_head(probe, 40_000)
    assert plan.build("single", {}, probe).env["VLLM_MTP_DRAFT_VOCAB"] == "1"
    p = plan.build("single", {"TP": "2"}, probe)
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "0" and p.settings["MTP_DRAFT_VOCAB"].source == "plan"
    [note] = [n for n in p.notes if n.startswith("MTP_DRAFT_VOCAB=0 because TP=2")]
    assert "20,000 per card" in note and "--k 39936" in note
    refused("single", {"TP": "2", "MTP_DRAFT_VOCAB": "1"}, probe, "MTP_DRAFT_VOCAB=1: TP=2", "--k 39936",
            "unset MTP_DRAFT_VOCAB")


def test_a_head_of_a_multiple_of_256_rows_serves_on_2_and_4_cards(probe):
    served_with_head(probe, 39_936)
    for tp in ("2", "4"):
        assert plan.build("single", {"TP": tp}, probe).env["VLLM_MTP_DRAFT_VOCAB"] == "1"


def test_a_list_that_would_build_a_head_that_does_not_split(probe):
    (probe.repo / "ids.json").write_text(json.dumps({"ids": list(range(40))}))
    p = plan.build("single", {"TP": "2", "DRAFT_IDS": "ids.json"}, probe)
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "0" and not [s for s in p.missing if "build_draft_vocab" in s.command]
    (probe.repo / "ids.json").write_text(json.dumps({"ids": list(range(128))}))
    p = plan.build("single", {"TP": "2", "DRAFT_IDS": "ids.json"}, probe)
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "1" and [s for s in p.missing if "build_draft_vocab" in s.command]


# ---- KV_MEM=auto over every visible card ----
def smi_rows(*cards_mib: tuple[int, int]) -> str:
    return "\n".join(f"{free}, {total}" for free, total in cards_mib)


def test_read_cards_reads_every_card_nvidia_smi_lists(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "smi", smi_rows((23000, 24576), (15000, 16384)))
    cards, source = plan.read_cards({"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert source in ("nvidia-smi", "torch.cuda.mem_get_info")
    if source == "nvidia-smi":  # this machine's torch sees no CUDA
        assert cards == ((23000 * MiB, 24576 * MiB), (15000 * MiB, 16384 * MiB))
    assert plan.read_cards({"PATH": str(fake), "CUDA_VISIBLE_DEVICES": ""})[0] == () or source != "nvidia-smi"


def test_the_smallest_card_decides_and_the_plan_says_so(probe):
    cards = ((int(23.0 * GiB), 24 * GiB), (int(15.0 * GiB), 16 * GiB))
    mixed = Probe(repo=probe.repo, cards=cards, free_vram=cards[1][0], total_vram=cards[1][1], vram_source="test")
    p = plan.build("single", {"TP": "2", "KV_MEM": "auto", "SPEC": "off"}, mixed)
    weights = memory.weights_bytes("off", fast_variant=False, tp=2)
    assert p.kv_mem == memory.auto_kv_mem(cards[1][0], weights, tp=2) > 0
    assert p.kv_mem == memory.auto_kv_mem(cards[1][0], weights) - memory.TP_COMM_BYTES  # the communicators' share
    [note] = [n for n in p.notes if "the smallest" in n]
    assert "23.00 GiB, 15.00 GiB" in note and "every card the same pool" in note
    text = "\n".join(plan.explain_lines(p, mixed))
    assert "free VRAM, card 0" in text and "free VRAM, card 1" in text and "card that decides" in text
    assert "KV_MEM=auto would pin" in text and "GiB per card" in text
    same = Probe(repo=probe.repo, cards=(cards[0], cards[0]), free_vram=cards[0][0], vram_source="test")
    assert not [n for n in plan.build("single", {"TP": "2", "KV_MEM": "auto"}, same).notes if "the smallest" in n]


def test_more_cards_than_tp_the_note_says_which(probe):
    cards = ((int(23.0 * GiB), 24 * GiB),) * 3
    p = plan.build("batch", {"TP": "2", "KV_MEM": "auto"}, Probe(repo=probe.repo, cards=cards, vram_source="test"))
    assert any("TP=2 uses 2 of them: CUDA_VISIBLE_DEVICES" in n for n in p.notes)


def test_fewer_cards_than_tp_is_refused(probe):
    one = Probe(repo=probe.repo, free_vram=int(23.6 * GiB), total_vram=24 << 30, vram_source="nvidia-smi")
    refused("single", {"TP": "2", "KV_MEM": "auto"}, one, "TP=2 needs 2 cards and nvidia-smi sees 1", "set TP=1")
    text = "\n".join(plan.explain_lines(plan.build("single", {"TP": "2"}, one), one))
    assert "TP=2 needs 2: vLLM will not start" in text


def test_explain_end_to_end_on_two_fake_cards(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "smi", smi_rows((22000, 24576), (14000, 16384)))
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO), "TP": "2", "KV_MEM": "auto"}
    r = subprocess.run([sys.executable, "-m", "qwen_serving.plan", "batch", "explain"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    if "nvidia-smi" in r.stdout:  # (a CUDA torch would read the real cards instead)
        assert "free VRAM, card 1" in r.stdout and "13.67 GiB" in r.stdout and "card that decides" in r.stdout
        assert "the smallest (13.67 GiB) decides" in r.stderr


# ---- preflight ----
def test_preflight_counts_the_cards_tp_needs():
    one = lambda: "NVIDIA GeForce RTX 3090, 24576, 580.95.05\n"  # noqa: E731
    two = lambda: "NVIDIA GeForce RTX 5060 Ti, 16311, 580.95.05\nNVIDIA GeForce RTX 5060 Ti, 16311, 580.95.05\n"  # noqa: E731
    [fail] = preflight.gpu_checks(one, tp=2)
    assert fail.level == "FAIL" and "TP=2" in fail.message and "nvidia-smi lists 1" in fail.message
    gpu = {c.name: c for c in preflight.gpu_checks(two, tp=2)}["gpu"]
    assert gpu.level == "PASS" and "TP=2" in gpu.message and "15.9 GiB" in gpu.message
    alone = {c.name: c for c in preflight.gpu_checks(two)}["gpu"]  # one 16 GB card: points at TP, not EXTRA_ARGS
    assert alone.level == "WARN" and "TP=2" in alone.message and "EXTRA_ARGS" not in alone.message
    assert preflight.tp_from_env({"TP": "4"}) == 4 and preflight.tp_from_env({}) == 1


def test_no_readme_advises_extra_args_for_tp():
    for doc in ("README.md", "batch/README.md", "single-user/README.md", *map(str, (REPO / "docs").glob("*.md"))):
        text = (REPO / doc).read_text()
        assert "EXTRA_ARGS=\"--tensor-parallel-size" not in text and "`--tensor-parallel-size 2`)" not in text, doc
    assert vllm_028.VERSION == "0.28.0"


def test_the_per_card_table_in_docs_memory_is_the_models():
    text = (REPO / "docs" / "memory.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
            for line in text.split("## Under TP", 1)[1].splitlines() if line.startswith("| ") and "TP=1" not in line}
    for tp, kv, state, weights in zip((1, 2, 4), *rows.values(), strict=True):
        assert kv == f"{memory.kv_bytes_per_token_layer('auto', kv_heads=model.KV_HEADS // tp) // 1024} KiB"
        assert state == f"{memory.gdn_state_bytes_per_layer('float16', 0, tp=tp) / MiB:.2f} MiB"
        assert weights == f"{memory.weights_bytes('mtp', fast_variant=False, tp=tp) / GiB:.2f} GiB"
