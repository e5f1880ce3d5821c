"""bench/gpu/scripted_mtp.py without a GPU: its servers (first wave and sweep) through vLLM 0.28.0's own `vllm
serve` parser, the acceptance maths (probabilistic drafts against a simulation of vLLM's rule, greedy drafts against
the reference's markov_acceptance, the exact greedy walk by hand), the prediction on the tiny scripted checkpoint
(with its reference check), and the measurements end to end against fake vLLM servers on loopback (sampled answers
drawn from the checkpoint's context-free table, a prefix cache, a profiler that writes a trace), whose /metrics
pages are the recorded one with the counters they keep; the chi-square rows from the tiny reference over the
fakes' samples; a deliberately wrong acceptance fails its check, and so does a fake that always samples the
chain (the likeliest token)."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import http.server
import json
import os
import random
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from bench import fullbench as fb
from bench import scripted_chisq as sc
from qwen_serving.checkpoint import scripted, synth
from qwen_serving.checkpoint.scripted_reference import (
    DEFAULT_SAMPLING,
    Reference,
    Sampling,
    markov_acceptance,
    markov_inputs,
    sampling_probs,
)
from qwen_serving.plan import Probe
from tests.helpers.fake_http import send_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import scripted_mtp as sm  # noqa: E402

RECORDED = (REPO / "bench" / "fixtures" / "recorded" / "metrics-tiny-mtp.txt").read_text()
CKPT, TRACES = Path("/ckpt/scripted"), Path("/out/traces")
COVERAGE = 0.6  # of the tiny checkpoint's draft id list (the GPU run asks sm.DEFAULT_COVERAGE)


def _command(cfg: fb.BenchConfig, port: int = 18060, ckpt: Path = CKPT) -> fb.ServerCommand:
    return fb.server_command(cfg, python="py", ckpt=ckpt, port=port, traces=TRACES, probe=Probe.detect(REPO))


def test_scripted_servers_are_plans_that_vllm_serve_parses(vllm_cli):
    methods = {}
    for name, cfg in {**fb.SCRIPTED_CONFIGS, **fb.SCRIPTED_VARIANTS, **fb.SCRIPTED_SWEEP,
                      **fb.SCRIPTED_HIGH_AGREE}.items():
        assert name not in fb.CONFIGS  # run_full.py's configs (and their recorded commands) stay as they were
        served = fb.serve_plan(cfg, ckpt=CKPT, port=18060, traces=TRACES, probe=Probe.detect(REPO))
        assert not served.warnings, served.warnings
        cmd = _command(cfg)
        ns, ea = vllm_cli.serve(cmd.argv)
        assert ns.model_tag == str(CKPT) and ea.max_model_len == fb.SCRIPTED_MAX_LEN == 4096
        assert ea.logprobs_mode == "raw_logits" and ea.gpu_memory_utilization == fb.SHARED_UTIL
        assert ea.kv_cache_memory_bytes == served.kv_mem and ea.max_num_seqs >= sm.GREEDY_PROMPTS
        assert cmd.env["VLLM_DISABLED_KERNELS"] == "MacheteLinearKernel"  # Marlin, as on the RTX 3090
        # each pool seats the greedy batch (prompts of ~250 tokens, 512-token answers) at once
        shape = dataclasses.replace(served.cache, kv_group_fix=cfg.patched)
        assert shape.residents(served.kv_mem, 260, sm.MAX_TOKENS) >= sm.GREEDY_PROMPTS, name
        assert (set(served.env) <= set(cmd.env)) if cfg.patched else not set(served.env) & set(cmd.env)
        spec = ea.speculative_config
        methods[name] = None if spec is None else (spec["num_speculative_tokens"], spec["draft_sample_method"])
        assert sm.draft_sample(cmd) == (None if spec is None else spec["draft_sample_method"])
    assert methods == {"scripted-stock": None, "scripted-stock-mtp4": (4, "greedy"), "scripted-patched-plain": None,
                       "scripted-patched-mtp4": (4, "probabilistic"), "scripted-patched-mtp4-fa2": (4, "probabilistic"),
                       "scripted-patched-mtp4-agree90": (4, "probabilistic"),
                       **{f"scripted-patched-mtp{k}": (k, "probabilistic") for k in fb.SCRIPTED_SWEEP_K},
                       **{f"scripted-stock-mtp{k}": (k, "greedy") for k in fb.SCRIPTED_SWEEP_K}}
    patched = _command(fb.SCRIPTED_CONFIGS["scripted-patched-mtp4"])
    assert patched.env["VLLM_MTP_DRAFT_VOCAB"] == "0" and patched.env["VLLM_SPEC_DECODE_ATTN"] == "1"
    fa2 = _command(fb.SCRIPTED_VARIANTS["scripted-patched-mtp4-fa2"])
    assert fa2.env["VLLM_SPEC_DECODE_ATTN"] == "1"  # the kernel on, on the FlashAttention it stands in for
    assert [vllm_cli.serve(c.argv)[1].attention_config.flash_attn_version for c in (fa2, patched)] == [2, None]
    ns, ea = vllm_cli.serve(patched.argv)
    assert ea.mamba_ssm_cache_dtype == "float16" and ea.max_num_batched_tokens == 2048  # the single-user plan's
    assert not ns.enable_auto_tool_choice and ns.tool_call_parser is None  # TOOLS=0: no ijson needed on the device


def test_dry_run_prints_every_wave(tmp_path):
    import subprocess

    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "scripted_mtp.py"), str(tmp_path / "o"),
                          "--dry-run", "--site", "/s", "--patched-site", "/p"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    commands = [line for line in res.stdout.splitlines() if line.startswith("PYTHONPATH=")]
    variants = ["PYTHONPATH=/p:/s"] * len(fb.SCRIPTED_VARIANTS)
    pairs = ["PYTHONPATH=/p:/s", "PYTHONPATH=/s"] * len(fb.SCRIPTED_SWEEP_K)  # each k: ours, then stock
    high = ["PYTHONPATH=/p:/s"] * len(fb.SCRIPTED_HIGH_AGREE)
    assert [c.split()[0] for c in commands] == ["PYTHONPATH=/s", "PYTHONPATH=/s", "PYTHONPATH=/p:/s",
                                               "PYTHONPATH=/p:/s", *variants, *pairs, *high]
    assert sum("/tmp/qwen-scripted-full-agree90-prepared " in c for c in commands) == len(high)
    ports = [int(re.search(r"--port (\d+)", c).group(1)) for c in commands]
    assert ports == list(range(18060, 18060 + len(commands)))  # never reused across waves
    assert not (tmp_path / "o").exists()
    # --from-run: the servers taken from the earlier run are not booted; the plan's MTP server leads the first wave
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "scripted_mtp.py"), str(tmp_path / "o"),
                          "--dry-run", "--site", "/s", "--patched-site", "/p", "--from-run", "earlier.json"],
                         capture_output=True, text=True, timeout=120)
    names = re.findall(r"^# (\S+) \(port", res.stdout, flags=re.M)
    assert names == ["scripted-patched-mtp4", "scripted-patched-mtp4-fa2",
                     *(f"scripted-{which}-mtp{k}" for k in sm.SWEEP_ORDER for which in ("patched", "stock")),
                     *fb.SCRIPTED_HIGH_AGREE]
    assert sorted(sm.SWEEP_ORDER) == sorted(fb.SCRIPTED_SWEEP_K)


def test_waves_are_packed_by_memory_in_order(tmp_path):
    args = argparse.Namespace(base_port=18060, site=Path("/s"), patched_site=Path("/p"), python=sys.executable,
                              ckpt=CKPT, prepared_ckpt=CKPT, high_prepared_ckpt=CKPT, high_agree=sm.HIGH_AGREE,
                              ablate=[], ablate_root=Path("/a"))
    full = sm.waves(args, tmp_path)
    for wave in full:
        assert sum(sm.server_gib(s.cfg) for s in wave) <= sm.run_full.BOUND_GIB
    # visit 10's first wave (111 GiB in use) is estimated above what it measured, and a fifth server does not fit
    assert [s.cfg.name for s in full[0]] == list(fb.SCRIPTED_CONFIGS)
    assert 111 < sum(sm.server_gib(s.cfg) for s in full[0]) and sum(
        sm.server_gib(s.cfg) for s in (*full[0], full[1][0])) > sm.run_full.BOUND_GIB
    for k in sm.SWEEP_ORDER:  # each k's pair boots in one wave
        assert len({i for i, w in enumerate(full) for s in w if s.cfg.name.endswith(f"-mtp{k}")}) == 1, k
    # an H100 (run_full.bound_gib's 69.2 GiB): smaller waves, the same servers in the same order
    h100 = sm.waves(args, tmp_path, bound=69.2)
    assert len(h100) > len(full) and [s.cfg.name for w in h100 for s in w] == [s.cfg.name for w in full for s in w]
    assert all(len(w) == 1 or sum(sm.server_gib(s.cfg) for s in w) <= 69.2 for w in h100)
    order = [s.cfg.name for w in full for s in w]
    assert order == [*fb.SCRIPTED_CONFIGS, *fb.SCRIPTED_VARIANTS,
                     *(f"scripted-{which}-mtp{k}" for k in sm.SWEEP_ORDER for which in ("patched", "stock")),
                     *fb.SCRIPTED_HIGH_AGREE]
    # servers taken from an earlier run are not booted again, wherever they stand in the order; the rest of the sweep
    # and the high-agreement server fit two waves, each k's pair in one
    taken = (*sm.FROM_RUN_SERVERS, "scripted-patched-mtp4", "scripted-patched-mtp4-fa2", "scripted-patched-mtp3",
             "scripted-stock-mtp3")
    rest = sm.waves(args, tmp_path, taken=taken)
    assert [s.cfg.name for w in rest for s in w] == [
        *(f"scripted-{which}-mtp{k}" for k in sm.SWEEP_ORDER[1:] for which in ("patched", "stock")),
        *fb.SCRIPTED_HIGH_AGREE]
    for k in sm.SWEEP_ORDER[1:]:
        assert len({i for i, w in enumerate(rest) for s in w if s.cfg.name.endswith(f"-mtp{k}")}) == 1, k
    assert [s.port for w in rest for s in w] == list(range(18060, 18060 + 2 * len(sm.SWEEP_ORDER[1:]) + 1))
    # --high-agree 0: no server on the copy
    off = argparse.Namespace(**{**vars(args), "high_agree": 0.0})
    assert not [s for w in sm.waves(off, tmp_path) for s in w if s.cfg.name in fb.SCRIPTED_HIGH_AGREE]
    # --ablate: the plan at k=4 without a patch boots in the wave of the plan's own k=4 server, from its own copy, and
    # the two lead the first wave even where the first wave's four servers would leave no room beside them
    ablated = argparse.Namespace(**{**vars(args), "ablate": ["gdn-spec-rows-no-sync.patch", "gdn-metadata-reuse.patch"]})
    name = f"{fb.ABLATION_PREFIX}gdn-spec-rows-no-sync"
    for taken in ((), sm.FROM_RUN_SERVERS):
        first = sm.waves(ablated, tmp_path, taken=taken)[0]
        assert [s.cfg.name for s in first][:3] == [sm.ABLATION_BASE, name, f"{fb.ABLATION_PREFIX}gdn-metadata-reuse"]
    server = first[1]
    assert server.pythonpath.split(os.pathsep) == ["/a/gdn-spec-rows-no-sync", "/s"]
    assert sm.draft_tokens(server.cmd) == sm.draft_tokens(first[0].cmd) == 4
    assert str(sm.served_checkpoint(args, name)) in server.cmd.argv  # the prepared copy, as the plan's server


def test_ablate_names_series_patches_and_keeps_the_plan_booting():
    base = ["/o", "--dry-run", "--site", "/s", "--patched-site", "/p"]
    assert sm.parse_args([*base, "--ablate", "gdn-spec-rows-no-sync.patch"]).ablate == ["gdn-spec-rows-no-sync.patch"]
    with pytest.raises(SystemExit):
        sm.parse_args([*base, "--ablate", "no-such.patch"])
    with pytest.raises(SystemExit):  # more than one wave holds beside the plan's k=4 server
        sm.parse_args([*base, "--ablate", ",".join(["gdn-spec-rows-no-sync.patch"] * 5)])
    with pytest.raises(SystemExit):  # the default --from-run-servers take the plan's k=4 server
        sm.parse_args([*base, "--ablate", "gdn-spec-rows-no-sync.patch", "--from-run", "r.json",
                       "--from-run-servers", "scripted-stock,scripted-patched-mtp4"])


def test_an_ablation_copy_has_the_series_but_one_and_leaves_stock_alone(tmp_path, pristine_vllm):
    from qwen_serving import patchset

    site = tmp_path / "site"
    site.mkdir()
    (site / "vllm").symlink_to(pristine_vllm)  # the stock tree, read through a link as the device's /tmp/site
    patches = patchset.read_series(patchset.DEFAULT_SERIES)
    without = "gdn-spec-rows-no-sync.patch"
    target = patches[[p.name for p in patches].index(without)].files[0]
    before = (pristine_vllm / target).read_bytes()
    dst = tmp_path / "ablate" / "gdn-spec-rows-no-sync"
    applied = sm.make_ablation_site(site, dst, patches, without)
    assert applied == [p.name for p in patches if p.name != without]
    state = patchset.evaluate(dst / "vllm", patches).states
    assert {n for n, s in state.items() if s is not patchset.State.APPLIED} == {without}
    assert (pristine_vllm / target).read_bytes() == before  # stock untouched
    assert (dst / "vllm" / target).stat().st_ino != (pristine_vllm / target).stat().st_ino
    assert not list(dst.parent.glob(".*making"))
    meas = {"scripted-patched-mtp4": {"c1": {"ms_per_step": 14.0, "spec": {"tokens_per_step": 3.1}}},
            f"{fb.ABLATION_PREFIX}gdn-spec-rows-no-sync": {"c1": {"ms_per_step": 15.0,
                                                                   "spec": {"tokens_per_step": 3.0}}}}
    (row,) = sm.ablation_table(meas)
    assert row["without"] == without and row["saved_ms"] == pytest.approx(1.0)
    meas["scripted-patched-mtp4"]["from_run"] = "earlier"  # another machine's step is no baseline
    assert sm.ablation_table(meas) == []


# ---------------------------------------------------------------- acceptance maths


def _simulate(target: list[list[float]], draft: list[list[float]], k: int, steps: int, seed: int) -> list[float]:
    """vLLM's rule step by step: draft d ~ draft[x], keep it with min(1, target/draft), a rejection emits from
    max(target - draft, 0), a full chain adds a bonus from target; per-position share of kept drafts."""
    rng = random.Random(seed)
    n = len(target)

    def pick(weights):
        return rng.choices(range(n), weights=weights)[0]

    kept = [0] * k
    start = 0
    for _ in range(steps):
        current = start
        for j in range(k):
            d = pick(draft[current])
            if rng.random() < min(1.0, target[current][d] / draft[current][d]):
                kept[j] += 1
                current = d
                continue
            start = pick([max(t - q, 0.0) for t, q in zip(target[current], draft[current], strict=True)])
            break
        else:
            start = pick(target[current])
    return [c / steps for c in kept]


def test_probabilistic_draft_acceptance_matches_a_simulation_of_vllms_rule():
    target = [[0.1, 0.8, 0.1], [0.2, 0.1, 0.7], [0.6, 0.3, 0.1]]
    draft = [[0.2, 0.6, 0.2], [0.5, 0.1, 0.4], [0.3, 0.3, 0.4]]
    k, steps = 3, 20_000
    predicted = sm.draft_acceptance(torch.tensor(target), torch.tensor(draft), k)
    simulated = _simulate(target, draft, k, steps, seed=1)
    for p, s in zip(predicted, simulated, strict=True):
        assert abs(p - s) <= 4 * (p * (1 - p) / steps) ** 0.5 + 1e-3, (predicted, simulated)
    # a drafter equal to the target keeps every draft
    assert sm.draft_acceptance(torch.tensor(target), torch.tensor(target), k) == pytest.approx([1.0] * k)


def test_greedy_walk_by_hand():
    successor = {0: 1, 1: 2, 2: 0}
    proposal = {0: 1, 1: 0, 2: 0}  # 0 and 2 propose their successor, 1 does not
    # first 0: drafts 1 (kept), 0 (not 2): emits 2 tokens, then 2: drafts 0, 1 (both kept), 6 tokens in all
    walk = sm.greedy_walk_acceptance([0], successor, proposal, k=2, max_tokens=6)
    assert walk == {"drafts": 2, "acceptance_per_position": [1.0, 0.5]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scripted-gpu") / "tiny"
    argv = ["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted", "--mtp-agree", "0.76",
            "--draft-coverage", str(COVERAGE)]
    assert synth.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def prediction(tiny) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference's many small ops: faster on one of the 2 shared cores
    try:
        return sm.predict(tiny, "cpu")
    finally:
        torch.set_num_threads(threads)


def test_prediction_from_the_tiny_checkpoint(tiny, prediction):
    assert prediction["default_sampling"] == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}  # generation_config
    assert prediction["mtp_agree"] == 0.76 and prediction["k"] == sm.K
    # greedy drafts: the reference's own markov_acceptance, and the general formula with one-hot drafts agrees
    ref = Reference(tiny)
    design = scripted.Design.read(tiny)
    transition, propose = markov_inputs(ref, design.active, DEFAULT_SAMPLING)
    by_reference = markov_acceptance(transition, propose, sm.K)
    assert prediction["acceptance_per_position"]["default_greedy_drafts"] == pytest.approx(by_reference)
    one_hot = torch.nn.functional.one_hot(propose, len(design.active)).double()
    assert sm.draft_acceptance(transition, one_hot, sm.K) == pytest.approx(by_reference, abs=1e-9)
    for name, profile in prediction["acceptance_per_position"].items():
        assert len(profile) == sm.K and all(1 >= a >= b >= 0 for a, b in zip(profile, profile[1:], strict=False)), name
        assert prediction["tokens_per_step"][name] == pytest.approx(1 + sum(profile))
        assert set(prediction["by_k"][name]) == {str(k) for k in sm.K_SWEEP}
    # vLLM's probabilistic drafts keep more than greedy ones at the same agreement (a drafter that agrees
    # proposes the target's own distribution, accepted with sum min(p, q) instead of p(chain))
    assert prediction["tokens_per_step"]["default_probabilistic_drafts"] > prediction["tokens_per_step"][
        "default_greedy_drafts"]
    # the greedy maps are the design's chain and MTP proposal
    assert {int(t): v for t, v in prediction["greedy_successor"].items()} == dict(zip(design.active, design.chain,
                                                                                      strict=True))
    assert all(prediction["mtp_proposal"][str(t)] == design.mtp_proposal(t) for t in design.active)
    # the reference follows the chain along the first greedy prompt, and the branches move its logits
    check = prediction["reference_check"]
    assert check["argmax_is_chain"] == check["positions"] == sm.REFERENCE_CHECK_TOKENS
    assert check["first_off_chain"] is None and check["wobble_std"] > 0.01 and check["min_top_gap"] > 0.8


def _run_args(tiny: Path, tmp_path: Path, **over) -> argparse.Namespace:
    values = {"ckpt": tiny, "prepared_ckpt": tmp_path / "prepared", "high_ckpt": tmp_path / "high",
              "high_prepared_ckpt": tmp_path / "high-prepared", "high_agree": sm.HIGH_AGREE, "python": sys.executable,
              "agree": 0.76,
              "coverage": COVERAGE, "site": Path("/nonexistent-site"), "device": "cpu", "budget_s": 600}
    return argparse.Namespace(**{**values, **over})


def test_the_patched_servers_serve_a_prepared_copy_with_its_draft_head(tiny, tmp_path, vllm_cli):
    import hashlib

    def digests(folder: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}

    before = digests(tiny)
    args = _run_args(tiny, tmp_path)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "SOURCE_DATE_EPOCH": "0"}
    assert sm.make_checkpoint(args, env, tmp_path, lambda limit: limit)["draft_coverage"] == pytest.approx(
        COVERAGE, abs=2 / len(scripted.Design.read(tiny).active))
    done = sm.prepare_copy(args, env, tmp_path, lambda limit: limit)
    assert set(done["steps_s"]) == {*sm.PREPARE_STEPS, "build_draft_vocab"}
    assert not any("FAIL" in line for line in done["prepare_status"]), done["prepare_status"]
    assert digests(tiny) == before  # the hard links still hold stock's bytes
    prepared = json.loads((args.prepared_ckpt / "config.json").read_text())
    ids = json.loads((tiny / scripted.DRAFT_IDS_FILE).read_text())["ids"]
    assert prepared["draft_vocab"]["size"] == len(ids) and "draft_vocab" not in json.loads(
        (tiny / "config.json").read_text())
    assert sm.prepare_copy(args, env, tmp_path, lambda limit: limit)["steps_s"]  # a second run: every step a no-op
    # the high-agreement copy: synth's target with another MTP dial, then prepared like the first
    high = sm.make_high_copy(args, env, tmp_path, lambda limit: limit)
    assert high["mtp_agree"] == sm.HIGH_AGREE and "redial_s" in high
    assert not any("FAIL" in line for line in high["prepared"]["prepare_status"]), high["prepared"]["prepare_status"]
    assert digests(tiny) == before
    assert "redial_s" not in sm.make_high_copy(args, env, tmp_path, lambda limit: limit)  # there: checked, kept
    # the plan serves the prepared copies' draft head (stock keeps the synth's files)
    for cfg in (fb.SCRIPTED_CONFIGS["scripted-patched-mtp4"], fb.SCRIPTED_CONFIGS["scripted-stock-mtp4"],
                *fb.SCRIPTED_HIGH_AGREE.values()):
        cmd = _command(cfg, ckpt=sm.served_checkpoint(args, cfg.name))
        ns, _ = vllm_cli.serve(cmd.argv)
        expected = {"stock": tiny, "patched": args.prepared_ckpt, "high": args.high_prepared_ckpt}[sm.files(cfg.name)]
        assert ns.model_tag == str(expected)
        assert cmd.env.get("VLLM_MTP_DRAFT_VOCAB") == ("1" if cfg.patched else None), cfg.name
    # a high-agreement copy of another target is refused
    other = _run_args(tiny, tmp_path, high_ckpt=args.prepared_ckpt)
    with pytest.raises(sm.CheckpointError, match="--mtp-agree"):
        sm.make_high_copy(other, env, tmp_path, lambda limit: limit)
    # a checkpoint that does not match the dials asked is refused before anything boots
    with pytest.raises(sm.CheckpointError, match="--draft-coverage"):
        sm.make_checkpoint(_run_args(tiny, tmp_path, coverage=0.9), env, tmp_path, lambda limit: limit)
    with pytest.raises(sm.CheckpointError, match="--mtp-agree"):
        sm.make_checkpoint(_run_args(tiny, tmp_path, agree=0.5), env, tmp_path, lambda limit: limit)
    # the prediction from the prepared files: every MTP proposal inside the draft list, the chain unchanged
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pred = sm.predict(args.prepared_ckpt, "cpu")
    finally:
        torch.set_num_threads(threads)
    design = scripted.Design.read(tiny)
    assert {int(t): v for t, v in pred["greedy_successor"].items()} == dict(zip(design.active, design.chain,
                                                                                strict=True))
    assert set(pred["mtp_proposal"].values()) <= set(ids) | {-1}
    assert pred["reference_check"]["argmax_is_chain"] == pred["reference_check"]["positions"]


# ---------------------------------------------------------------- end to end against fake servers


class FakeVllm(http.server.ThreadingHTTPServer):
    """The OpenAI completions a vLLM server answers (the designed chain, raw top-20 logits, streamed chunks of
    `per_step` tokens), and its /metrics: the recorded page with the counters this fake keeps, incremented per
    request by the acceptance profile it is told to show (greedy requests: `greedy_rates`, others: `rates`)."""

    DRAFTS_PER_ANSWER = 1000

    def __init__(self, design: scripted.Design, greedy_rates: list[float] | None, rates: list[float] | None,
                 logit_noise: float = 0.0, *, table: torch.Tensor, trace_dir: Path, broken_sampler: bool = False):
        self.design, self.greedy_rates, self.rates, self.noise = design, greedy_rates, rates, logit_noise
        self.spec = greedy_rates is not None
        self.table, self.trace_dir, self.broken = table, trace_dir, broken_sampler
        self.lock = threading.Lock()
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * sm.K, "tpot": [0.0, 0],
                       "hits": 0, "requests": 0}
        self.cached: set[tuple[int, ...]] = set()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = fake.page().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
                    fake.control(self.path)
                    send_json(self, {})
                    return
                if body["temperature"] == sc.SAMPLING["temperature"] and not body.get("stream"):  # chi-square
                    send_json(self, {"choices": [{"index": 0, "text": "x",
                                                  "token_ids": fake.sample(body["prompt"][-1], body["max_tokens"])}]})
                    return
                prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
                fake.cache(prompts)
                answers = [fake.design.walk(p[-1], body["max_tokens"])[1:] for p in prompts]
                fake.count(len(prompts), body["temperature"] == 0)
                if not body.get("stream"):
                    send_json(self, {"choices": [fake.choice(i, a, body) for i, a in enumerate(answers)],
                                "usage": {"completion_tokens": sum(map(len, answers))}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                tokens = answers[0]
                pieces = [tokens[:1]] + [tokens[i:i + 3] for i in range(1, len(tokens), 3)]
                for piece in pieces:
                    chunk = {"choices": [{"index": 0, "text": "x", "token_ids": piece}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 1}})}\n\n"
                                 .encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def control(self, path: str) -> None:
        if path == "/reset_prefix_cache":
            self.cached.clear()
        elif path == "/stop_profile":  # the worker's trace, as vLLM's torch profiler leaves one
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "marlin", "ts": 1.0, "dur": 2.0}]}
            (self.trace_dir / "worker.pt.trace.json").write_text(json.dumps(trace))

    def cache(self, prompts: list[list[int]]) -> None:
        with self.lock:
            for p in prompts:
                if tuple(p) in self.cached:
                    self.counts["hits"] += len(p)
                self.cached.add(tuple(p))

    def sample(self, last: int, n: int) -> list[int]:
        """n tokens from the context-free table at sc.SAMPLING (the broken fake: always the likeliest)."""
        with self.lock:
            self.counts["requests"] += 1
            gen = torch.Generator().manual_seed(self.counts["requests"])
        index = {t: i for i, t in enumerate(self.design.active)}
        out = []
        for _ in range(n):
            row = self.table[index[last]]
            last = self.design.active[int(row.argmax() if self.broken else torch.multinomial(row, 1, generator=gen))]
            out.append(last)
        return out

    def count(self, answers: int, greedy: bool) -> None:
        with self.lock:
            self.counts["tpot"][0] += answers * 0.01
            self.counts["tpot"][1] += answers
            if not self.spec:
                return
            rates = self.greedy_rates if greedy else self.rates
            drafts = answers * self.DRAFTS_PER_ANSWER
            self.counts["drafts"] += drafts
            self.counts["draft_tokens"] += drafts * sm.K
            for pos, rate in enumerate(rates):
                self.counts["per_pos"][pos] += round(rate * drafts)
                self.counts["accepted"] += round(rate * drafts)

    def choice(self, index: int, tokens: list[int], body: dict) -> dict:
        choice = {"index": index, "text": "x", "token_ids": tokens}
        if body.get("logprobs"):
            others = self.design.active[:40]
            tops = []
            for position, token in enumerate(tokens):
                top = {f"token_id:{token}": 2.0 + self.noise * (position % 3)}
                for other in others:
                    if len(top) < body["logprobs"] and other != token:
                        top[f"token_id:{other}"] = -12.0
                tops.append(top)
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in tokens],
                                  "token_logprobs": [t[f"token_id:{tok}"] for t, tok in zip(tops, tokens, strict=True)],
                                  "top_logprobs": tops}
        return choice

    def page(self) -> str:
        with self.lock:
            c = self.counts
            values = {"vllm:spec_decode_num_drafts_total": c["drafts"],
                      "vllm:spec_decode_num_draft_tokens_total": c["draft_tokens"],
                      "vllm:spec_decode_num_accepted_tokens_total": c["accepted"],
                      "vllm:request_time_per_output_token_seconds_sum": c["tpot"][0],
                      "vllm:request_time_per_output_token_seconds_count": c["tpot"][1],
                      "vllm:prefix_cache_hits_total": c["hits"]}
            lines = []
            for line in RECORDED.splitlines():
                if "vllm:spec_decode" in line and not self.spec:
                    continue  # a server without speculation exports none of them
                name = line.split("{")[0]
                if name in values:
                    line = f"{line.rsplit(' ', 1)[0]} {float(values[name])}"
                elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                    pos = int(re.search(r'position="(\d+)"', line).group(1))
                    line = f"{line.rsplit(' ', 1)[0]} {float(c['per_pos'][pos])}"
                lines.append(line)
            return "\n".join(lines) + "\n"


@pytest.fixture
def fakes(tiny, prediction, tmp_path):
    design = scripted.Design.read(tiny)
    prompts = sm.prompts_for(design, "greedy", sm.GREEDY_PROMPTS)
    successor = {int(t): v for t, v in prediction["greedy_successor"].items()}
    proposal = {int(t): v for t, v in prediction["mtp_proposal"].items()}
    walk = sm.greedy_walk_acceptance([successor[p["ids"][-1]] for p in prompts], successor, proposal, sm.K,
                                     sm.MAX_TOKENS)["acceptance_per_position"]
    wrong = list(prediction["acceptance_per_position"]["default_probabilistic_drafts"])
    wrong[2] += 0.05  # the patched server's fake accepts 5 points too many at the third position
    ref = Reference(tiny)
    active = torch.tensor(design.active)
    table = sampling_probs(ref.context_free_logits(design.active), Sampling(**sc.SAMPLING))[:, active].float()
    traces = tmp_path / "out"
    servers = {"scripted-stock": FakeVllm(design, None, None, table=table, trace_dir=traces / "traces-scripted-stock"),
               "scripted-stock-mtp4": FakeVllm(design, walk, prediction["acceptance_per_position"][
                   "default_greedy_drafts"], logit_noise=0.01, table=table,
                   trace_dir=traces / "traces-scripted-stock-mtp4"),
               "scripted-patched-plain": FakeVllm(design, None, None, table=table,
                                                  trace_dir=traces / "traces-scripted-patched-plain"),
               "scripted-patched-mtp4": FakeVllm(design, walk, wrong, table=table, broken_sampler=True,
                                                 trace_dir=traces / "traces-scripted-patched-mtp4")}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def test_measurements_end_to_end_and_a_wrong_acceptance_fails(tiny, prediction, fakes, tmp_path, monkeypatch):
    import run_full

    design = scripted.Design.read(tiny)
    args = argparse.Namespace(patched_site=None, python=sys.executable, ckpt=tiny, prepared_ckpt=tiny, agree=0.76,
                              coverage=COVERAGE, budget_s=sm.DEFAULT_BUDGET_S)
    rec = sm.start_record(tmp_path / sm.REPORT, args, {"PYTHONPATH": str(REPO)})
    rec.data["prediction"] = rec.data["prediction_prepared"] = prediction  # both stacks serve the same files here
    monkeypatch.setattr(sm, "CHISQ_TOKENS", 4 * sm.CHISQ_ANSWER)  # 4 answers; the GPU run sends 196
    prompts = sm.make_prompts(design)
    prompts = dataclasses.replace(prompts, sampled=prompts.sampled[:4], c1=prompts.c1[:2])
    greedy = prompts.greedy
    out = tmp_path / "out"
    for name, fake in fakes.items():
        cfg = fb.SCRIPTED_CONFIGS[name]
        port = fake.server_address[1]
        server = run_full.Server(cfg, _command(cfg, port, tiny), port, "", tmp_path / f"{name}.log")
        sm.measure_one(server, rec, prompts, sm.default_sampling(tiny), lambda limit: limit, out)
    assert not rec.data["errors"], rec.data["errors"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = Reference(tiny)
    for name in rec.samples:  # what the --chisq-rows child computes once the servers are down
        rec.rows[name] = sc.position_rows(ref, prompts.chisq, rec.samples[name])
    torch.set_num_threads(threads)
    assert sm.finish(rec, design, greedy) is False  # the wrong acceptance and the broken sampler
    data = json.loads((tmp_path / sm.REPORT).read_text())
    for key in ("schema", "date", "gpu", "versions", "patches", "checkpoint", "k", "prediction",
                "prediction_prepared", "measurements", "checks", "passed", "phases_s", "skipped", "errors"):
        assert key in data, key
    assert data["patches"]["series"] == [line for line in (REPO / "patches" / "series").read_text().splitlines()
                                         if line and not line.startswith("#")]
    meas = data["measurements"]
    assert set(meas) == set(fakes) and "sampled" not in meas["scripted-stock"] | meas["scripted-patched-plain"]
    assert meas["scripted-stock"]["greedy"]["spec"]["speculative"] is False
    assert (tmp_path / "scripted-stock-greedy.json").exists()  # the traces, beside the report
    c1_stock = meas["scripted-stock"]["c1"]
    assert c1_stock["client_tokens_per_chunk"] == pytest.approx(511 / 171) and c1_stock["server_tpot_ms"] == pytest.approx(10.0)
    mtp = meas["scripted-stock-mtp4"]
    assert mtp["draft_sample"] == "greedy" and meas["scripted-patched-mtp4"]["draft_sample"] == "probabilistic"
    assert mtp["c1"]["ms_per_step"] == pytest.approx(10.0 * mtp["c1"]["spec"]["tokens_per_step"])
    checks = data["checks"]
    failed = sorted(name for name, check in checks.items() if not check["passed"])
    assert failed == ["scripted-patched-mtp4: chi-square of the sampled tokens' ranks against the reference",
                      "scripted-patched-mtp4: default-sampling acceptance per position = prediction "
                      "(default_probabilistic_drafts)"]
    wrong = checks[failed[1]]
    assert wrong["difference"][2] == pytest.approx(0.05, abs=1e-3) and wrong["within"] == sm.ACCEPTANCE_WITHIN
    # --rejudge reads the same verdicts back from the files beside the report (the rows as the child writes them)
    for name, rows in rec.rows.items():
        (tmp_path / f"{name}-chisq-rows.json").write_text(json.dumps([[list(row.items()) for row in seq] for seq in rows]))
    assert sm.rejudge(tmp_path) == 1
    again = json.loads((tmp_path / sm.REPORT).read_text())
    assert sorted(name for name, check in again["checks"].items() if not check["passed"]) == failed
    assert again["checks"].keys() == checks.keys() and again["notes"][-1].endswith("changed: none")
    # --from-run: a sweep-only run takes this first wave (its report, the answers gzipped in the folder named like
    # it) and judges its checks again, all but the chi-square, whose rows stay with the earlier run
    kept = tmp_path / "results" / "scripted-h200-mtp-run9.json"
    (kept.with_suffix("")).mkdir(parents=True)
    kept.write_text(json.dumps({**again, "checkpoint": {**again["checkpoint"], "mtp_agree": 0.76, "draft_coverage": 0.9}}))
    for name in fakes:
        answers = (tmp_path / f"{name}-greedy.json").read_bytes()
        (kept.with_suffix("") / f"{name}-greedy.json.gz").write_bytes(gzip.compress(answers))
    sampled = sorted(rec.samples)
    for name in sampled:  # the chi-square samples travel too: their rows are computed in the later run
        samples = (tmp_path / f"{name}-chisq-samples.json").read_bytes()
        (kept.with_suffix("") / f"{name}-chisq-samples.json.gz").write_bytes(gzip.compress(samples))
    later = sm.start_record(tmp_path / "later" / sm.REPORT, args, {"PYTHONPATH": str(REPO)})
    later.data["checkpoint"].update(mtp_agree=0.76, draft_coverage=0.9)
    later.data["prediction"] = later.data["prediction_prepared"] = prediction
    assert sm.take_servers(later, kept, list(fakes)) == list(fakes)
    assert later.data["from_run"]["servers"] == list(fakes) and set(later.traces) == set(fakes)
    assert later.data["measurements"]["scripted-stock"]["from_run"].startswith("scripted-h200-mtp-run9.json")
    assert sorted(later.samples) == sampled and later.samples == rec.samples
    assert all((tmp_path / "later" / f"{name}-chisq-samples.json").is_file() for name in sampled)  # for the child
    sm.finish(later, design, greedy)
    chisq = {name for name in checks if "chi-square" in name}
    assert later.data["checks"].keys() == checks.keys() - chisq  # no rows yet
    later.rows.update(rec.rows)
    sm.finish(later, design, greedy)
    assert later.data["checks"].keys() == checks.keys()
    assert {n: c["passed"] for n, c in later.data["checks"].items() if n in chisq} == {
        n: checks[n]["passed"] for n in chisq}
    assert {r["from_run"] for r in sm.sweep_table(later.data["measurements"])} == {
        later.data["measurements"]["scripted-stock"]["from_run"]}
    later.data["checkpoint"]["draft_coverage"] = 0.5
    with pytest.raises(sm.CheckpointError, match="draft_coverage"):
        sm.take_servers(later, kept, list(fakes))
    # a measurement the earlier run took from another keeps that origin
    later.data["checkpoint"]["draft_coverage"] = 0.9
    earlier = json.loads(kept.read_text())
    earlier["measurements"]["scripted-stock"]["from_run"] = "run8"
    kept.write_text(json.dumps(earlier))
    assert sm.take_servers(later, kept, ["scripted-stock"]) == ["scripted-stock"]
    assert later.data["measurements"]["scripted-stock"]["from_run"] == "run8"
    # ... and its answers are found in the origin's folder when the later report's folder does not repeat them
    earlier["measurements"]["scripted-stock"]["from_run"] = "scripted-h200-mtp-run8.json (2026-12-01)"
    kept.write_text(json.dumps(earlier))
    origin = kept.parent / "scripted-h200-mtp-run8"
    origin.mkdir()
    (kept.with_suffix("") / "scripted-stock-greedy.json.gz").rename(origin / "scripted-stock-greedy.json.gz")
    later.traces.clear()
    assert sm.take_servers(later, kept, ["scripted-stock"]) == ["scripted-stock"]
    assert len(later.traces["scripted-stock"]) == len(greedy)
    (origin / "scripted-stock-greedy.json.gz").unlink()
    with pytest.raises(sm.CheckpointError, match="has its answers"):
        sm.take_servers(later, kept, ["scripted-stock"])
    # reference x2 (each stack's files); chain x4; identity, logits, greedy walk x2 (each against its own stack's
    # plain server); sampled x2; chi-square x2; prefix x2
    assert len(checks) == 2 + 4 + 2 * 3 + 2 + 2 + 2
    assert "scripted-patched-mtp4: greedy token-identical to no speculation" in checks
    # the high-agreement server: judged against the plan's answers without speculation (the same target), its own
    # floor on the acceptance, no prediction of its own (so no greedy walk, no sampled check)
    high = next(iter(fb.SCRIPTED_HIGH_AGREE))
    traces = {**rec.traces, high: rec.traces["scripted-patched-mtp4"]}
    for rates, passed in (([0.9, 0.8, 0.7, 0.6], True), ([0.8, 0.6, 0.45, 0.35], False)):
        greedy_part = json.loads(json.dumps(meas["scripted-patched-mtp4"]["greedy"]))
        greedy_part["spec"]["per_position_acceptance"] = rates
        data = {**rec.data, "measurements": {**rec.data["measurements"], high: {"k": 4, "greedy": greedy_part}}}
        judged = {n: c for n, c in sm.judge(data, traces, {}, {}, design, greedy).items() if n.startswith(high)}
        floor = judged.pop(f"{high}: greedy drafts accepted at least 60% of the time")
        assert floor["passed"] is passed and floor["acceptance"] == pytest.approx(sum(rates) / 4)
        assert {n: c["passed"] for n, c in judged.items()} == {
            f"{high}: greedy answers are the designed chain": True,
            f"{high}: greedy token-identical to no speculation": True,
            f"{high}: top-20 raw logits agree with no speculation": True}
    chisq = checks["scripted-stock: chi-square of the sampled tokens' ranks against the reference"]
    assert chisq["tokens"] == sm.CHISQ_TOKENS and chisq["outside_support"] == 0 and chisq["ranks"] == 3, chisq
    assert (tmp_path / "scripted-stock-chisq-samples.json").exists()
    broken = checks["scripted-patched-mtp4: chi-square of the sampled tokens' ranks against the reference"]
    assert broken["observed"][0] == broken["tokens"] and broken["p_value"] < 1e-6  # always the likeliest token
    prefix = checks["scripted-stock: a cache hit gives the same tokens and raw logits"]
    assert prefix["hit_tokens"] == [0, len(prompts.prefix)] and prefix["same_tokens"]
    for name in fakes:
        profile = meas[name]["profile"]
        assert (out / "profiles" / profile["trace"]).stat().st_size == profile["trace_bytes"] > 0
    identical = checks["scripted-stock-mtp4: greedy token-identical to no speculation"]
    assert identical["token_identical_prompts"] == sm.GREEDY_PROMPTS
    logits = checks["scripted-stock-mtp4: top-20 raw logits agree with no speculation"]
    assert logits["max_abs_diff"] == pytest.approx(0.02) and logits["passed"]  # 0.02 < 4 bf16 steps at 2.0


def test_off_chain_answers_and_logit_drift_fail():
    chain = [11, 12, 13, 14, 15, 16]
    good = sm.smoke_lib.GreedyTrace(chain, [2.0] * 6, [{t: 2.0, 7: -12.0} for t in chain])
    assert sm.chain_check([good], [chain])["passed"]
    bad = dataclasses.replace(good, token_ids=chain[:3] + [7] + chain[4:])
    assert sm.chain_check([bad], [chain])["off_chain"] == [{"prompt": 0, "position": 3}]
    drift = dataclasses.replace(good, top=[{t: 2.0 + 0.07, 7: -12.0} for t in chain])  # 4.5 bf16 steps at 2
    result = sm.logit_agreement([good], [drift])
    assert not result["passed"] and result["over_count"] == 6 and result["max_diff_bf16_ulps"] == pytest.approx(4.48)


def test_logit_agreement_counts_steps_at_the_rows_scale():
    # a small logit beside a top of 2.0 moves by 2.0's bf16 steps (0.0156): 0.012 is 6 steps at 0.4's own spacing
    # but under one at the row's; a floor logit at -11.8 is rounded 0.0625 apart
    chain = [11, 12, 13]
    plain = sm.smoke_lib.GreedyTrace(chain, [2.0] * 3, [{t: 2.0, 5: 0.4, 7: -11.8125} for t in chain])
    verify = dataclasses.replace(plain, top=[{t: 2.0, 5: 0.412, 7: -11.75} for t in chain])
    result = sm.logit_agreement([plain], [verify])
    assert result["passed"] and result["logits_compared"] == 9
    assert result["max_diff_bf16_ulps"] == pytest.approx(1.0)  # the floor logit: one step at its own value
    moved = dataclasses.replace(plain, top=[{t: 2.0, 5: 0.47, 7: -11.8125} for t in chain])  # 4.5 steps at 2.0
    assert sm.logit_agreement([plain], [moved])["over_count"] == 3


def test_the_chisq_rows_child_gives_the_reference_rows_or_says_why_not(tiny, tmp_path):
    """The --chisq-rows child as the run starts it (here on the CPU, the tiny checkpoint): its rows are the
    reference's own position_rows; a child that fails leaves the reason under errors and no rows."""
    design = scripted.Design.read(tiny)
    prompts = [design.walk(design.active[0], 5), design.walk(design.active[7], 5)]
    samples = [design.walk(prompts[0][-1], 3)[1:], design.walk(prompts[1][-1], 3)[1:]]
    args = argparse.Namespace(python=sys.executable, ckpt=tiny, prepared_ckpt=tiny, device="cpu", patched_site=None,
                              agree=0.76, coverage=COVERAGE, budget_s=sm.DEFAULT_BUDGET_S)
    rec = sm.start_record(tmp_path / sm.REPORT, args, {"PYTHONPATH": str(REPO)})
    name = "scripted-patched-mtp4"
    rec.keep_samples(name, prompts, samples)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sm.take_chisq_rows(rec, tmp_path, name, sm.chisq_rows_child(name, tmp_path, env, args), 300, 0.0)
    assert not rec.data["errors"], rec.data["errors"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = sc.position_rows(Reference(tiny), prompts, samples)
    finally:
        torch.set_num_threads(threads)
    got = rec.rows[name]
    assert [len(seq) for seq in got] == [len(seq) for seq in want] == [3, 3]
    for seq_got, seq_want in zip(got, want, strict=True):
        for row_got, row_want in zip(seq_got, seq_want, strict=True):
            assert row_got.keys() == row_want.keys()
            assert all(abs(row_got[t] - row_want[t]) < 1e-6 for t in row_want)
    # a child whose samples file is missing fails: the error is recorded, the rows stay unset
    other = "scripted-stock"
    sm.take_chisq_rows(rec, tmp_path, other, sm.chisq_rows_child(other, tmp_path, env, args), 300, 0.0)
    assert other not in rec.rows and f"{other}: chisq rows" in rec.data["errors"]


def test_the_sweep_plot_names_the_runs_its_rows_came_from(monkeypatch, tmp_path):
    titles = []
    monkeypatch.setattr(sm.br, "plot_sweep", lambda rows, title, path: titles.append(title))
    rows = [{"stack": "stock", "k": 0, "from_run": "scripted-h200-mtp-run3.json (2026-12-02T04:14:03+00:00)"},
            {"stack": "stock", "k": 1}]
    sm.plot({"gpu": {"name": "H200"}, "date": "2026-12-03T10:00:00", "sweep": rows}, tmp_path / sm.REPORT)
    sm.plot({"gpu": {"name": "H200"}, "date": "2026-12-03T10:00:00", "sweep": rows[1:]}, tmp_path / sm.REPORT)
    assert titles == ["MTP k sweep, scripted model, H200, 2026-12-03 (and run3)",
                      "MTP k sweep, scripted model, H200, 2026-12-03"]
