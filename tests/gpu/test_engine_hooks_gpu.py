"""Engine hooks on a GPU: sampler-small-topk.patch, spec-decode-attn.patch, prefill-int8-attn.patch.

- the patched apply_top_k_top_p at the real 248k vocabulary gives the masks of vLLM's own dispatch at 1, 4, 8, 16
  and 64 rows, tied and exact-top-p rows included (tests/helpers/sampler_rows.py);
- the patched FlashAttentionImpl at the 27B attention geometry (24 query / 4 KV heads, head_dim 256): verify
  batches through the split-KV kernel and a 2048-token prefill chunk after 12k of context through the int8
  kernel agree with FlashAttention 2 and 3 on the same paged cache;
- four offline engines on the tiny checkpoint, started together (tests/gpu/engine_hooks_child.py): MTP (k=4)
  with both hooks on, MTP with both off, no speculation (the control for the MTP engine itself), and MTP with
  the hooks on under torch.compile and CUDA graphs, as a server runs it (its greedy against the eager one). Greedy
  outputs of hooks on vs off, and of MTP without hooks vs no speculation, token-identical or differing only at
  measured near-ties (smoke_lib.compare_greedy); each divergence is recorded with both runs' top-20 raw logits at
  that position. The hooks-on engine really took the kernels (verify batches; the chunks of a prompt prefilled
  alone), and every paged attention call of every engine (our kernels and FlashAttention) matched exact fp32
  attention over the same cache (the children's shadow check).
Numbers go to $QS_GPU_RESULTS/engine-hooks-h200.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import smoke_lib as lib

from bench import serving
from qwen_serving.model import HEAD_DIM, KV_HEADS, Q_HEADS, VOCAB
from tests.helpers.sampler_rows import designed

pytestmark = pytest.mark.gpu

RESULTS, WORK = lib.RESULTS, lib.WORK
CHILD = Path(__file__).with_name("engine_hooks_child.py")
ENGINE_TIMEOUT_S = 900
HQ, HKV, D = Q_HEADS, KV_HEADS, HEAD_DIM
# name: (HOOKS, SPEC, eager|graphs) of the child; "graphs" is the hooks-on engine as a server runs it
ENGINES = {"on": ("1", "mtp", "eager"), "off": ("0", "mtp", "eager"), "plain": ("0", "none", "eager"),
           "graphs": ("1", "mtp", "graphs")}
_record: dict = {}


def _cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def _save() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    serving.write_json_atomic(RESULTS / "engine-hooks-h200.json", _record)


def test_sampler_masks_equal_vllm_at_full_vocab(monkeypatch):
    monkeypatch.setenv("VLLM_SMALL_TOPK_SAMPLER", "1")
    _cuda()
    from vllm.v1.sample.ops import topk_topp_sampler as stock

    from qwen_serving.engine import sampler_routing

    calls = []
    real = sampler_routing.apply_top_k_top_p_small_k
    monkeypatch.setattr(sampler_routing, "apply_top_k_top_p_small_k", lambda *a, **k: calls.append(1) or real(*a, **k))
    mismatched = {}
    # vLLM's own dispatch (no host bound): its sort below 8 rows, its Triton top-k/top-p from 8 rows, which keeps
    # exactly k tokens at a tie; the kernel stands in below 8 rows only (issue #17: the distribution exactly vLLM's)
    for rows in (1, 4, 8, 16, 64):
        logits, k, p = designed(rows, VOCAB, device="cuda")
        for pp in (p, None):
            want = stock.apply_top_k_top_p(logits.clone(), k, pp).isinf()
            got = stock.apply_top_k_top_p(logits.clone(), k, pp, int(k.max())).isinf()
            mismatched[f"rows={rows} top_p={pp is not None}"] = int((got != want).any(dim=1).sum())
    _record["sampler_rows_with_other_masks"] = mismatched
    _save()
    assert len(calls) == 4  # rows 1 and 4, with and without top-p
    assert not any(mismatched.values()), mismatched


def _flash_impl(fa, enabled: bool, monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config

    monkeypatch.setenv("VLLM_SPEC_DECODE_ATTN", "1" if enabled else "0")
    config = VllmConfig()
    config.scheduler_config.max_num_seqs = 8
    config.attention_config.flash_attn_version = 2  # built as on a 3090: on FA3 (sm90) the hooks stand aside
    with set_current_vllm_config(config):
        return fa.FlashAttentionImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV, alibi_slopes=None,
                                     sliding_window=None, kv_cache_dtype="auto")


@pytest.mark.parametrize("fa_version", [2, 3])
def test_verify_attention_matches_flash_attention(fa_version, monkeypatch):
    torch = _cuda()
    from vllm.v1.attention.backends import flash_attn as fa

    from qwen_serving.engine import attn_routing

    page, q_len, seq_lens = 16, 5, [16384, 9000, 1500, 5]
    gen = torch.Generator(device="cuda").manual_seed(fa_version)
    pages = [-(-s // page) for s in seq_lens]
    kv = torch.randn(sum(pages) + 4, page, HKV, 2 * D, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(kv.shape[0], device="cuda", generator=gen).int()
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = perm[used : used + n]
        used += n
    qsl = torch.arange(0, q_len * len(seq_lens) + 1, q_len, dtype=torch.int32, device="cuda")
    md = fa.FlashAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=q_len, query_start_loc=qsl, max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_table=block_table,
        slot_mapping=None, use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
        suffix_kv_lens=None)
    q = torch.randn(int(qsl[-1]), HQ, D, device="cuda", generator=gen).bfloat16()
    ones = torch.ones(1, device="cuda")
    layer = SimpleNamespace(_q_scale=ones, _k_scale=ones, _v_scale=ones)
    outputs = {}
    routed = []
    decide = attn_routing.takes_verify_path
    monkeypatch.setattr(attn_routing, "takes_verify_path", lambda *a: routed.append(decide(*a)) or routed[-1])
    for enabled in (True, False):
        impl = _flash_impl(fa, enabled, monkeypatch)
        impl.vllm_flash_attn_version = fa_version
        out = torch.empty_like(q)
        impl.forward(layer, q, None, None, kv.transpose(1, 2), md, out)
        outputs[enabled] = out.float()
    assert routed == [True]
    diff = (outputs[True] - outputs[False]).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(outputs[True].flatten(), outputs[False].flatten(), dim=0).item()
    _record.setdefault("verify_vs_flash_attention", {})[f"fa{fa_version}"] = {"max_abs": diff, "cos": cos}
    _save()
    assert diff <= 1e-2 and cos >= 0.9999


@pytest.mark.parametrize("fa_version", [2, 3])
def test_prefill_int8_chunk_matches_flash_attention(fa_version, monkeypatch):
    # a 2048-token chunk after 12k tokens of context, over 528-token pages (a hybrid model's attention page)
    torch = _cuda()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends import flash_attn as fa

    page, n_q, n_k = 528, 2048, 12288 + 2048
    gen = torch.Generator(device="cuda").manual_seed(10 + fa_version)
    pages = -(-n_k // page)
    kv = torch.randn(pages + 4, page, HKV, 2 * D, device="cuda", generator=gen).bfloat16()
    block_table = torch.randperm(pages + 4, device="cuda", generator=gen).int()[None, :]
    md = fa.FlashAttentionMetadata(
        num_actual_tokens=n_q, max_query_len=n_q, query_start_loc=torch.tensor([0, n_q], dtype=torch.int32,
                                                                                device="cuda"),
        max_seq_len=n_k, seq_lens=torch.tensor([n_k], dtype=torch.int32, device="cuda"), block_table=block_table,
        slot_mapping=None, use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
        suffix_kv_lens=None)
    q = torch.randn(n_q, HQ, D, device="cuda", generator=gen).bfloat16()
    ones = torch.ones(1, device="cuda")
    layer = SimpleNamespace(_q_scale=ones, _k_scale=ones, _v_scale=ones)
    outputs = {}
    for enabled in (True, False):
        monkeypatch.setenv("VLLM_PREFILL_INT8_ATTN", "1" if enabled else "0")
        config = VllmConfig()
        config.attention_config.flash_attn_version = 2  # built as on a 3090 (see _flash_impl)
        with set_current_vllm_config(config):
            impl = fa.FlashAttentionImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV,
                                         alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
        assert impl.prefill_int8 is enabled
        impl.vllm_flash_attn_version = fa_version
        out = torch.empty_like(q)
        impl.forward(layer, q, None, None, kv.transpose(1, 2), md, out)
        outputs[enabled] = out.float()
    got, want = outputs[True], outputs[False]
    cos = torch.nn.functional.cosine_similarity(got.transpose(0, 1).flatten(1), want.transpose(0, 1).flatten(1), dim=1)
    diff = (got - want).abs().max().item()
    _record.setdefault("prefill_int8_vs_flash_attention", {})[f"fa{fa_version}"] = {
        "min_head_cos": cos.min().item(), "max_abs": diff}
    _save()
    assert cos.min().item() >= 0.9999 and diff <= 0.05


@pytest.fixture(scope="module")
def mtp_engines() -> dict[str, dict]:
    _cuda()
    work = WORK / "engine-hooks"
    work.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = Path(os.environ.get("QS_GPU_TINY_CKPT", work / "tiny"))
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "tiny", "--out", str(model),
                        "--seed", "0", "--force"], cwd=lib.REPO, env=lib.child_env(os.environ), check=True, timeout=600)
    children = {}
    for name, (hooks, spec, mode) in ENGINES.items():
        out = work / f"engine-hooks-{name}.json"
        children[name] = ([sys.executable, str(CHILD), str(model), str(out), hooks, spec, mode], out,
                          RESULTS / f"engine-hooks-{name}.log")
    return {name: {**child.record, "rc": child.rc, "log_tail": child.log[-3000:] if child.rc != 0 else ""}
            for name, child in lib.run_json_children(children, lib.child_env(os.environ), ENGINE_TIMEOUT_S).items()}


def test_mtp_greedy_same_with_verify_kernel(mtp_engines):
    on, off = _ok(mtp_engines["on"]), _ok(mtp_engines["off"])
    _record["mtp_greedy_hooks_on_vs_off"] = {
        **_compare(on, off, "batch"), "routed_on": on["routed"]["batch"], "routed_off": off["routed"]["batch"],
        "start_s": {"on": on["start_s"], "off": off["start_s"]}}
    _save()
    assert on["routed"]["batch"]["verify"] > 0, "no verify batch reached the kernel"
    assert off["routed"]["batch"] == {"verify": 0, "prefill": 0}
    unexplained = _record["mtp_greedy_hooks_on_vs_off"]["unexplained"]
    assert not unexplained, unexplained


def test_single_prompt_prefill_through_int8_kernel(mtp_engines):
    on, off = _ok(mtp_engines["on"]), _ok(mtp_engines["off"])
    _record["single_prompt_hooks_on_vs_off"] = {**_compare(on, off, "single"), "routed_on": on["routed"]["single"]}
    _save()
    assert on["routed"]["single"]["prefill"] >= 3, "the long prompt's chunks did not reach the int8 kernel"
    unexplained = _record["single_prompt_hooks_on_vs_off"]["unexplained"]
    assert not unexplained, unexplained


def test_mtp_without_hooks_same_as_no_speculation(mtp_engines):
    # the control: if MTP alone changes these prompts' greedy outputs, hooks on vs off is no test of the hooks
    off, plain = _ok(mtp_engines["off"]), _ok(mtp_engines["plain"])
    results = {name: _compare(off, plain, name) for name in ("single", "batch")}
    _record["mtp_hooks_off_vs_no_speculation"] = results
    _save()
    unexplained = {name: r["unexplained"] for name, r in results.items() if r["unexplained"]}
    assert not unexplained, unexplained


def test_hooks_under_cuda_graphs_same_as_eager(mtp_engines):
    # issue #17 item 5: the verify checks as served. Attention inside a captured graph is routed while the graph
    # is captured (counted at start) and replayed after; attention left outside the graphs is routed step by step
    # (counted per run). Either way the kernel must be reached, and greedy must equal the eager hooks-on engine's
    graphs, on = _ok(mtp_engines["graphs"]), _ok(mtp_engines["on"])
    results = {name: _compare(graphs, on, name) for name in ("single", "batch")}
    _record["hooks_cuda_graphs_vs_eager"] = {**results, "routed_at_start": graphs["routed_at_start"],
                                            "routed": graphs["routed"],
                                            "start_s": {"graphs": graphs["start_s"], "eager": on["start_s"]}}
    _save()
    reached = graphs["routed_at_start"]["verify"] + graphs["routed"]["batch"]["verify"]
    assert reached > 0, "no verify batch reached the kernel, captured or step by step"
    unexplained = {name: r["unexplained"] for name, r in results.items() if r["unexplained"]}
    assert not unexplained, unexplained


def test_every_attention_call_matches_exact_attention(mtp_engines):
    # the eager children re-did each paged attention call in fp32 over the same cache (engine_hooks_child.ShadowCheck)
    shadows = {name: _ok(run)["shadow"] for name, run in mtp_engines.items() if not run.get("graphs")}
    _record["attention_calls_vs_exact"] = shadows
    _save()
    assert shadows["on"]["batch"].get("verify_kernel", {}).get("calls"), "no verify kernel call was checked"
    assert shadows["on"]["single"].get("prefill_int8_kernel", {}).get("calls"), "no prefill chunk was checked"
    bad = {f"{name}/{workload}/{kind}": stats["worst_call"]
           for name, by_workload in shadows.items() for workload, kinds in by_workload.items()
           for kind, stats in kinds.items() if stats["bad_calls"]}
    assert not bad, bad


def _compare(run_a: dict, run_b: dict, workload: str) -> dict:
    """compare_greedy's summary plus, at each divergence, both runs' top-20 raw logits there and their spread
    (top-1 minus top-20): a flat distribution makes a tie likely, a steep one with disjoint tokens does not."""
    traces_a, traces_b = (_traces(run, workload) for run in (run_a, run_b))
    comparison = lib.compare_greedy(traces_a, traces_b)
    summary = comparison.summary()
    for entry, divergence in zip(summary["divergences"], comparison.divergences, strict=True):
        if divergence.token_a < 0:
            continue  # outputs of different lengths
        for side, traces in (("a", traces_a), ("b", traces_b)):
            top = sorted(traces[divergence.prompt].top[divergence.position].items(), key=lambda kv: -kv[1])
            entry[f"top_{side}"] = [[token, logit] for token, logit in top]
            entry[f"spread_{side}"] = top[0][1] - top[-1][1] if top else None
        entry["common_top_tokens"] = len({t for t, _ in entry["top_a"]} & {t for t, _ in entry["top_b"]})
    summary["unexplained"] = [d.reason for d in comparison.unexplained]
    return summary


def _ok(run: dict) -> dict:
    assert run.get("rc") == 0, f"engine failed (rc {run.get('rc')}):\n{run.get('log_tail')}"
    return run


def _traces(run: dict, name: str) -> list:
    return [lib.GreedyTrace.from_record(t) for t in run["traces"][name]]
