"""The full-shape GPU flow without a GPU: every config's server argv through vLLM 0.28.0's own `vllm serve`
parser, the measurements each config runs, the stock-reproduction check, and bench/gpu/run_full.py's CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bench import fullbench as fb
from qwen_serving.plan import Probe

REPO = Path(__file__).resolve().parents[1]
RUN_FULL = REPO / "bench" / "gpu" / "run_full.py"
CKPT, TRACES = Path("/ckpt/full"), Path("/out/traces-x")


def command(name: str) -> fb.ServerCommand:
    return fb.server_command(fb.CONFIGS[name], python="py", ckpt=CKPT, port=18025, traces=TRACES,
                             probe=Probe.detect(REPO))


def plan_of(name: str):
    return fb.serve_plan(fb.CONFIGS[name], ckpt=CKPT, port=18025, traces=TRACES, probe=Probe.detect(REPO))


@pytest.mark.parametrize("name", list(fb.CONFIGS))
def test_every_config_is_a_serve_plan_that_vllm_serve_parses(name, vllm_cli):
    cfg = fb.CONFIGS[name]
    served = plan_of(name)  # the plan's own checks passed (a refusal raises PlanError)
    assert served.mode == cfg.mode and not served.warnings, served.warnings
    cmd = command(name)
    ns, ea = vllm_cli.serve(cmd.argv)
    assert ns.model_tag == str(CKPT) and ns.port == 18025 and ns.host == "127.0.0.1"
    assert ea.served_model_name in (fb.SERVED_NAME, [fb.SERVED_NAME])
    assert ea.max_model_len == fb.MAX_LEN and ea.language_model_only and ea.gdn_prefill_backend == "triton"
    # the plan's argv, less only the flags the config leaves to vLLM
    assert list(cmd.argv[4:]) == fb.without_flags(served.argv[2:], cfg.vllm_defaults)
    assert all(getattr(ea, flag.removeprefix("--").replace("-", "_")) is None for flag in cfg.vllm_defaults)
    if not cfg.shared_start:  # the reference launch: vLLM's profiling and defaults, no profiler
        assert ea.kv_cache_memory_bytes is None and ea.gpu_memory_utilization == 0.9
        assert ea.profiler_config.profiler is None and ea.max_num_seqs is None
        return
    # shared-GPU start: a fixed pool, so vLLM's memory profiling (which other processes would upset) is skipped
    assert ea.kv_cache_memory_bytes == served.kv_mem == served.value("KV_MEM")
    assert ea.gpu_memory_utilization == fb.SHARED_UTIL
    # vLLM 0.28.0 refuses to capture CUDA graphs for more seats than the pool has GDN state blocks (H200, 1024 > 544)
    assert ea.max_num_seqs == served.value("MAX_SEQS") <= served.cache.num_blocks(served.kv_mem)
    prof = ea.profiler_config
    prof = prof if isinstance(prof, dict) else vars(prof)
    assert prof["profiler"] == "torch" and prof["torch_profiler_dir"] == str(TRACES) and prof["ignore_frontend"]
    assert cmd.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and cmd.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (cmd.env.get("VLLM_DISABLED_KERNELS") == "MacheteLinearKernel") is cfg.marlin_forced
    # a patched server gets every export of its plan; stock vLLM none of them
    assert (set(served.env) <= set(cmd.env)) if cfg.patched else not set(served.env) & set(cmd.env)


def _stock_vllm_env() -> set[str]:
    """The VLLM_* names pristine vLLM 0.28.0 reads (tests/run.sh patches a copy; the venv's own stays stock)."""
    pristine = os.environ.get("QS_PRISTINE_VLLM") or Path(sysconfig.get_paths()["purelib"]) / "vllm"
    envs = (Path(pristine) / "envs.py").read_text()
    return set(re.findall(r'^    "(VLLM_[A-Z0-9_]+)":', envs, re.M))


def test_stock_servers_get_no_patch_variables():
    stock_env = _stock_vllm_env()
    assert {"VLLM_USE_FLASHINFER_SAMPLER", "VLLM_SERVER_DEV_MODE", "VLLM_DISABLED_KERNELS"} <= stock_env
    dropped = set()
    for name, cfg in fb.CONFIGS.items():
        if cfg.patched:
            continue
        assert set(command(name).env) <= stock_env, name
        dropped |= set(plan_of(name).env)
    assert dropped == {"VLLM_SPEC_DECODE_ATTN", "VLLM_MTP_DRAFT_VOCAB"}  # the MTP configs' plan exports
    assert not dropped & stock_env  # read by our patches only: dropping them changes nothing on stock vLLM


BEFORE = json.loads((REPO / "tests" / "fixtures" / "fullbench-commands-before-plan.json").read_text())["configs"]
# Engine arguments that must be the same as in the hand-written commands from before the plan
SAME = ("model", "served_model_name", "max_model_len", "max_num_seqs", "kv_cache_memory_bytes",
        "gpu_memory_utilization", "kv_cache_dtype", "max_num_batched_tokens", "language_model_only",
        "gdn_prefill_backend", "enable_auto_tool_choice", "tool_call_parser", "quantization")


def test_fixture_holds_every_config():
    assert set(BEFORE) == set(fb.CONFIGS)


@pytest.mark.parametrize("name", list(fb.CONFIGS))
def test_commands_do_what_the_hand_written_ones_did(name, vllm_cli, tmp_path):
    """Each config's command against the one bench/fullbench.py wrote by hand before it went through the plan
    (tests/fixtures/fullbench-commands-before-plan.json): the same engine arguments, and where the plan names
    what the old command left to vLLM, the value vLLM 0.28.0 picked for it."""
    from dataclasses import fields

    from vllm.config import SpeculativeConfig

    from qwen_serving.checkpoint.synth import write_config_files

    before, now = BEFORE[name], command(name)
    (old_ns, old), (new_ns, new) = vllm_cli.serve(tuple(before["argv"])), vllm_cli.serve(now.argv)
    for arg in SAME:
        assert getattr(new, arg, getattr(new_ns, arg, None)) == getattr(old, arg, getattr(old_ns, arg, None)), arg
    assert (vars(new.profiler_config), new_ns.host, new_ns.port) == (vars(old.profiler_config), old_ns.host,
                                                                     old_ns.port)
    # the recurrent state: `auto` is the checkpoint's mamba_ssm_dtype (float32 in the synthesised full model)
    if old.mamba_ssm_cache_dtype == "auto":
        write_config_files(tmp_path, "full", 4)
        config = json.loads((tmp_path / "config.json").read_text())
        assert new.mamba_ssm_cache_dtype == config.get("text_config", config)["mamba_ssm_dtype"]
    else:
        assert new.mamba_ssm_cache_dtype == old.mamba_ssm_cache_dtype
    # prefix caching: 0.28.0's default for hybrids, whose mamba cache mode it then sets to align
    assert old.enable_prefix_caching in (None, True) and new.enable_prefix_caching is True
    assert old.mamba_cache_mode in ("none", "align") and new.mamba_cache_mode == "align"
    # async scheduling: vLLM turns it on without speculation and for MTP (config/vllm.py); the H200 engine config
    # recorded it so (bench/results/h200-full-stock-single.json)
    assert old.async_scheduling in (None, True) and new.async_scheduling is True
    # attention: FlashAttention is vLLM's first choice on sm90 for a bf16 KV cache (platforms/cuda.py); fp8 KV
    # (the batch plan) was left to vLLM before and still is
    assert old.attention_backend is None
    assert str(new.attention_backend) in (("None",) if new.kv_cache_dtype == "fp8" else ("FLASH_ATTN",
                                                                                        "AttentionBackendEnum.FLASH_ATTN"))
    # speculation: the same method and depth; draft sampling named as vLLM's default
    default_sampling = {f.name: f.default for f in fields(SpeculativeConfig)}["draft_sample_method"]
    if old.speculative_config is None:
        assert new.speculative_config is None
    else:
        assert new.speculative_config == {**old.speculative_config, "draft_sample_method": default_sampling}
    # the environment: the same, plus VLLM_MTP_DRAFT_VOCAB=0: the synthetic checkpoint has no draft head and there
    # is no id list, so the plan serves the full lm_head (issue 15), which the patch does with no head anyway
    added = {k: v for k, v in now.env.items() if k not in before["env"]}
    assert {k: now.env[k] for k in before["env"]} == before["env"]
    if added:
        assert added == {"VLLM_MTP_DRAFT_VOCAB": "0"}


def _cache_shape(name: str):
    """memory.CacheShape of a config's server: its plan's, less the kv-group fix where the patches are not."""
    return dataclasses.replace(plan_of(name).cache, kv_group_fix=fb.CONFIGS[name].patched)


def test_pools_seat_the_largest_cohort():
    from qwen_serving.memory import CacheShape

    for name, cfg in fb.CONFIGS.items():
        if not cfg.shared_start:
            continue  # vLLM sizes its pool from 0.9 of the GPU (~100 GB on the H200)
        shape, served = _cache_shape(name), plan_of(name)
        assert shape.fits(served.kv_mem, fb.MAX_LEN), name
        cohort = 64 if "batch" in cfg.runs else 8 if "single" in cfg.runs else 1
        assert shape.residents(served.kv_mem, 128, 512) >= cohort, name
        # vLLM 0.28.0 refuses more seats than the pool has blocks: on the H200, stock's 28 GB pool with its default
        # 1024 seats failed with "exceeds available Mamba cache blocks (544)", memory.CacheShape's count
        assert cohort <= served.value("MAX_SEQS") <= shape.num_blocks(served.kv_mem), name
    stock = CacheShape(state_dtype="float32", prefix_cache=True, kv_group_fix=False)
    assert _cache_shape("stock") == dataclasses.replace(stock, async_scheduling=True)
    assert stock.num_blocks(plan_of("stock").kv_mem) == 544


def test_memory_model_matches_the_h200_servers():
    """The full-shape servers with a fixed pool of both H200 visits (2026-11-29): their block count and block
    size as the harness recorded them (bench/results/h200-full-<config>-single.json, from /metrics), and the
    'GPU KV cache size: N tokens' line each printed at boot (server logs, not kept)."""
    boot_tokens_of = {"stock": 377_665, "stock-mtp4": 83_107, "patched-batch": 430_786,
                      # the second visit (same day)
                      "stock-machete": 53_456, "stock-fp16state": 229_225, "patched-mtp4": 83_107,
                      "stock-mtp7": 73_408}
    for name, boot_tokens in boot_tokens_of.items():
        shape = _cache_shape(name)
        report = json.loads((REPO / "bench" / "results" / f"h200-full-{name}-single.json").read_text())
        recorded = report["server"]["cache_config"]
        kv_bytes = plan_of(name).kv_mem
        assert shape.num_blocks(kv_bytes) == int(recorded["num_gpu_blocks"]), name
        assert shape.block_size == int(recorded["block_size"]), name
        assert shape.pool_tokens(kv_bytes, fb.MAX_LEN) == boot_tokens, name


def test_runs_follow_the_config():
    stock = fb.runs_for(fb.CONFIGS["stock"], python="py", repo=REPO, url="http://h:1", out=Path("/o"), ckpt=CKPT,
                        traces=TRACES)
    assert [r.part for r in stock] == ["single", "batch", "single-run2", "batch-run2", "ladder", "steps"]
    single = stock[0].argv
    assert single[:3] == ("py", str(REPO / "bench" / "harness.py"), "single")
    assert single[single.index("--tag") + 1] == "h200-full-stock-single" and "--ignore-eos" in single
    run2 = stock[2].argv
    assert run2[run2.index("--cohorts") + 1] == "1" and run2[run2.index("--tag") + 1] == "h200-full-stock-single-run2"
    steps = stock[5].argv
    assert steps[steps.index("--trace-dir") + 1] == str(TRACES) and steps[steps.index("--model-dir") + 1] == str(CKPT)
    assert steps[steps.index("--out") + 1] == "/o/h200-full-stock-steps.json"
    mtp = fb.runs_for(fb.CONFIGS["stock-mtp7"], python="py", repo=REPO, url="u", out=Path("/o"), ckpt=CKPT,
                      traces=TRACES)
    assert [r.part for r in mtp] == ["single"]
    ref = fb.runs_for(fb.CONFIGS["stock-ref"], python="py", repo=REPO, url="u", out=Path("/o"), ckpt=CKPT,
                      traces=TRACES)
    assert [r.part for r in ref] == ["single", "batch", "single-run2", "batch-run2"]  # what reference_check reads
    machete = fb.runs_for(fb.CONFIGS["stock-machete"], python="py", repo=REPO, url="u", out=Path("/o"), ckpt=CKPT,
                          traces=TRACES)
    assert [r.part for r in machete] == ["single", "single-run2"]  # repeat repeats only what the config runs
    patched = fb.runs_for(fb.CONFIGS["patched-defaults"], python="py", repo=REPO, url="u", out=Path("/o"),
                          ckpt=CKPT, traces=TRACES)
    assert [r.part for r in patched] == ["single", "batch", "context"]
    context = patched[2].argv
    assert {"--prefill", "--long"} <= set(context) and context[context.index("--num-prompts") + 1] == "1"
    assert context[context.index("--tag") + 1] == "h200-full-patched-defaults-context"
    with pytest.raises(ValueError, match="unknown run kind 'warp'"):
        fb.runs_for(fb.BenchConfig("x", False, runs=("warp",)), python="py", repo=REPO, url="u", out=Path("/o"),
                    ckpt=CKPT, traces=TRACES)


def test_no_report_file_name_is_shared():
    """A config's part reports (h200-full-<config>-<part>.json) and every merged report (h200-full-<config>.json)
    share one folder: no name may stand for two files (a config `patched` would write its batch part over
    `patched-batch`'s merged report)."""
    names = [f"h200-full-{name}" for name in fb.CONFIGS]
    for cfg in fb.CONFIGS.values():
        names += [f"h200-full-{cfg.name}-{run.part}" for run in fb.runs_for(
            cfg, python="py", repo=REPO, url="u", out=Path("/o"), ckpt=CKPT, traces=TRACES)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _report(cohort: str, rate: float, tpot: float) -> dict:
    key = "decode_tok_s" if cohort == "C1" else "e2e_output_tok_s"
    return {"cohorts": {cohort: {key: rate, "tpot_ms": {"mean": tpot}}}}


def test_reference_check_compares_like_with_like():
    good = {"single": _report("C1", 118.5, 8.44), "single-run2": _report("C1", 113.0, 8.85),
            "batch": _report("C64", 3000.0, 18.9), "batch-run2": _report("C64", 3100.0, 18.2)}
    check = fb.reference_check(good, fb.REFERENCE)
    assert check["reproduced"] is True
    row = check["runs"]["C1"][1]
    assert row["run"] == "single-run2" and row["decode_tok_s_off_by"] == pytest.approx(113.0 / 117.8 - 1)
    assert row["tpot_ms_off_by"] == pytest.approx(8.85 / 8.49 - 1)
    # the H200 run of 2026-11-29: C64 output 2,745 tok/s and TPOT 20.86 ms against 3,024 and 18.7
    h200 = {**good, "batch": _report("C64", 2744.8, 20.86), "batch-run2": _report("C64", 2747.7, 20.85)}
    assert fb.reference_check(h200, fb.REFERENCE)["reproduced"] is False
    slow_tpot = {**good, "batch-run2": _report("C64", 3100.0, 19.7)}  # throughput fine, TPOT 5.3% over
    assert fb.reference_check(slow_tpot, fb.REFERENCE)["reproduced"] is False
    missing = {**good, "single-run2": None}
    check = fb.reference_check(missing, fb.REFERENCE)
    assert check["reproduced"] is False and len(check["runs"]["C1"]) == 1
    merged = fb.merge("stock", "cmd", good, {})
    assert merged["reference_check"]["reproduced"] and merged["single"] == good["single"]
    assert "reference_check" not in fb.merge("stock-mtp4", "cmd", {"single": None}, {"single": "exit 1"})
    # Machete: C1 only, as a decode rate (the issue gives no TPOT for it)
    machete = fb.merge("stock-machete", "cmd", {"single": _report("C1", 99.1, 10.09),
                                                 "single-run2": _report("C1", 104.0, 9.62)}, {})["reference_check"]
    assert machete["reproduced"] and set(machete["runs"]) == {"C1"}
    assert machete["runs"]["C1"][0]["decode_tok_s_off_by"] == pytest.approx(99.1 / 100.8 - 1)
    assert "tpot_ms" not in machete["runs"]["C1"][0]
    slow = fb.merge("stock-machete", "cmd", {"single": _report("C1", 95.0, 10.5), "single-run2": None}, {})
    assert slow["reference_check"]["reproduced"] is False


def run_full(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_FULL), *args], capture_output=True, text=True, timeout=300)


def test_run_full_rejects_unknown_configs(tmp_path):
    res = run_full(str(tmp_path / "out"), "stock", "turbo")
    assert res.returncode == 2 and "unknown config 'turbo'" in res.stderr
    assert not (tmp_path / "out").exists()


def test_run_full_patched_needs_a_patched_vllm(tmp_path):
    res = run_full(str(tmp_path / "out"), "stock", "patched-batch")
    assert res.returncode == 2 and "need --patched-site" in res.stderr
    res = run_full(str(tmp_path / "out"), "patched-defaults", "--patched-site", str(tmp_path))
    assert res.returncode == 2 and "no vllm package there" in res.stderr


def test_run_full_reference_launch_boots_alone(tmp_path):
    res = run_full(str(tmp_path / "out"), "stock-ref", "stock", "--dry-run")
    assert res.returncode == 2 and "stock-ref boots with vLLM's memory profiling" in res.stderr
    res = run_full(str(tmp_path / "out"), "stock-ref", "--dry-run")
    assert res.returncode == 0 and "--gpu-memory-utilization 0.9" in res.stdout and "--profiler-config" not in res.stdout


def test_run_full_dry_run_lists_servers_and_runs(tmp_path):
    res = run_full(str(tmp_path / "out"), "stock", "stock-mtp4", "patched-batch", "--patched-site", "/p",
                   "--site", "/s", "--base-port", "19000", "--dry-run")
    assert res.returncode == 0, res.stderr
    heads = [line for line in res.stdout.splitlines() if line.startswith("# ")]
    assert [h.split()[1:4] for h in heads] == [["stock", "(port", "19000):"], ["stock-mtp4", "(port", "19001):"],
                                             ["patched-batch", "(port", "19002):"]]
    commands = [line for line in res.stdout.splitlines() if line.startswith("PYTHONPATH=")]
    assert commands[0].startswith("PYTHONPATH=/s ") and commands[2].startswith("PYTHONPATH=/p:/s ")
    assert '"num_speculative_tokens": 4' in commands[1] and "VLLM_MARLIN_INPUT_DTYPE=int8" in commands[2]
    assert "  steps: " in res.stdout and not (tmp_path / "out").exists()


def test_measuring_keeps_the_merged_report_current(monkeypatch, tmp_path):
    """A visit whose device time runs out inside a config still leaves its merged report, with the parts done
    and the ones that were not (on the H200 `patched` lost its merged report that way)."""
    sys.path.insert(0, str(RUN_FULL.parent))
    import run_full as rf

    cfg = fb.CONFIGS["patched-defaults"]
    server = rf.Server(cfg, fb.ServerCommand(("vllm", "serve"), {}), 18020, "", tmp_path / "server.log")
    seen = []

    def fake_run(argv, **kwargs):
        tag = argv[argv.index("--tag") + 1]
        seen.append(tag)
        if len(seen) == 3:
            raise KeyboardInterrupt  # the visit ends during the third run
        (tmp_path / f"{tag}.json").write_text(json.dumps({"cohorts": {"C1": {"tag": tag}}}))
        return subprocess.CompletedProcess(argv, 0 if len(seen) == 1 else 1)

    monkeypatch.setattr(rf.subprocess, "run", fake_run)
    monkeypatch.setattr(rf, "gpu_state", lambda: "0 %, 0 MiB")
    args = argparse.Namespace(python="py", ckpt=CKPT)
    with pytest.raises(KeyboardInterrupt):
        rf.measure(server, args, tmp_path, None)
    merged = json.loads((tmp_path / "h200-full-patched-defaults.json").read_text())
    assert merged["single"] == {"cohorts": {"C1": {"tag": "h200-full-patched-defaults-single"}}}
    assert merged["batch"]["cohorts"]["C1"]["tag"] == "h200-full-patched-defaults-batch"
    assert merged["errors"] == {"batch": "exit 1 (see h200-full-patched-defaults-batch.log)", "unfinished": "context"}
