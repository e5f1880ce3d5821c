"""The full-shape GPU flow without a GPU: every config's server argv through vLLM 0.28.0's own `vllm serve`
parser, the measurements each config runs, the stock-reproduction check, and bench/gpu/run_full.py's CLI."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fullbench as fb
from qwen_serving.plan import Probe

REPO = Path(__file__).resolve().parents[1]
RUN_FULL = REPO / "bench" / "gpu" / "run_full.py"
CKPT, TRACES = Path("/ckpt/full"), Path("/out/traces-x")


@pytest.mark.parametrize("name", list(fb.CONFIGS))
def test_every_config_parses_through_vllm_serve(name, vllm_cli):
    cfg = fb.CONFIGS[name]
    cmd = fb.server_command(cfg, python="py", ckpt=CKPT, port=18025, traces=TRACES, probe=Probe.detect(REPO))
    assert cmd.argv[1:4] == ("-m", "vllm.entrypoints.cli.main", "serve")
    ns, ea = vllm_cli.serve(cmd.argv)
    assert ns.model_tag == str(CKPT) and ns.port == 18025 and ns.host == "127.0.0.1"
    assert ea.served_model_name in (fb.SERVED_NAME, [fb.SERVED_NAME])
    if not cfg.shared_start:  # the reference launch: vLLM's profiling and defaults, no profiler
        assert ea.kv_cache_memory_bytes is None and ea.gpu_memory_utilization == 0.9
        assert ea.profiler_config.profiler is None
        assert ea.max_num_seqs is None and ea.speculative_config is None
        return
    # shared-GPU start: a fixed pool, so vLLM's memory profiling (which other processes would upset) is skipped
    assert ea.kv_cache_memory_bytes == cfg.kv_bytes and ea.gpu_memory_utilization == fb.SHARED_UTIL
    assert ea.max_model_len == fb.MAX_LEN and ea.language_model_only and ea.gdn_prefill_backend == "triton"
    # vLLM 0.28.0 refuses to capture CUDA graphs for more seats than the pool has GDN state blocks (H200, 1024 > 544)
    assert ea.max_num_seqs == (64 if cfg.product == "batch" else cfg.max_num_seqs)
    prof = ea.profiler_config
    prof = prof if isinstance(prof, dict) else vars(prof)
    assert prof["profiler"] == "torch" and prof["torch_profiler_dir"] == str(TRACES) and prof["ignore_frontend"]
    assert cmd.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert (cmd.env.get("VLLM_DISABLED_KERNELS") == "MacheteLinearKernel") is cfg.marlin_forced
    spec = ea.speculative_config
    if cfg.spec_tokens:
        assert spec == {"method": "mtp", "num_speculative_tokens": cfg.spec_tokens}
    else:
        assert spec is None
    if cfg.product == "batch":  # the serve plan's batch mode, not a hand copy of it
        assert cmd.env["VLLM_MARLIN_INPUT_DTYPE"] == "int8" and cmd.env["VLLM_MARLIN_INT8_INCLUDE_RE"] == "mlp"
        assert ea.mamba_ssm_cache_dtype == "float16" and ea.kv_cache_dtype == "fp8" and ea.max_num_seqs == 64
        assert ea.enable_prefix_caching and ea.async_scheduling
    else:
        assert "VLLM_MARLIN_INPUT_DTYPE" not in cmd.env and ea.kv_cache_dtype == "auto"
        assert ea.mamba_ssm_cache_dtype == (cfg.state_dtype or "auto")  # auto: the checkpoint's float32
    assert (cmd.env.get("VLLM_SPEC_DECODE_ATTN") == "1") is (cfg.patched and cfg.spec_tokens > 0)


def _cache_shape(cfg: fb.BenchConfig):
    """memory.CacheShape of a config's server."""
    from qwen_serving.memory import CacheShape

    if cfg.product == "batch":
        return CacheShape(kv_dtype="fp8", state_dtype="float16", prefix_cache=True)
    # stock keeps the checkpoint's fp32 state; 0.28.0 turns prefix caching on for hybrid models
    return CacheShape(state_dtype=cfg.state_dtype or "float32", spec="mtp" if cfg.spec_tokens else "off",
                      spec_tokens=cfg.spec_tokens, prefix_cache=True, kv_group_fix=cfg.patched)


def test_pools_seat_the_largest_cohort():
    from qwen_serving.memory import CacheShape

    for cfg in fb.CONFIGS.values():
        if not cfg.shared_start:
            continue  # vLLM sizes its pool from 0.9 of the GPU (~100 GB on the H200)
        shape = _cache_shape(cfg)
        assert shape.fits(cfg.kv_bytes, fb.MAX_LEN), cfg.name
        cohort = 64 if "batch" in cfg.runs else 8 if "single" in cfg.runs else 1
        assert shape.residents(cfg.kv_bytes, 128, 512) >= cohort, cfg.name
        # vLLM 0.28.0 refuses more seats than the pool has blocks: on the H200, stock's 28 GB pool with its default
        # 1024 seats failed with "exceeds available Mamba cache blocks (544)", memory.CacheShape's count
        seats = 64 if cfg.product == "batch" else cfg.max_num_seqs  # the batch plan's MAX_SEQS
        assert cohort <= seats <= shape.num_blocks(cfg.kv_bytes), cfg.name
    stock = CacheShape(state_dtype="float32", prefix_cache=True, kv_group_fix=False)
    assert stock.num_blocks(fb.CONFIGS["stock"].kv_bytes) == 544


def test_memory_model_matches_the_h200_servers():
    """The full-shape servers with a fixed pool of both H200 visits (2026-11-29): their block count and block
    size as the harness recorded them (bench/results/h200-full-<config>-single.json, from /metrics), and the
    'GPU KV cache size: N tokens' line each printed at boot (server logs, not kept)."""
    boot_tokens_of = {"stock": 377_665, "stock-mtp4": 83_107, "patched-batch": 430_786,
                      # the second visit (same day)
                      "stock-machete": 53_456, "stock-fp16state": 229_225, "patched-mtp4": 83_107,
                      "stock-mtp7": 73_408}
    for name, boot_tokens in boot_tokens_of.items():
        shape = _cache_shape(fb.CONFIGS[name])
        report = json.loads((REPO / "bench" / "results" / f"h200-full-{name}-single.json").read_text())
        recorded = report["server"]["cache_config"]
        kv_bytes = fb.CONFIGS[name].kv_bytes
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
