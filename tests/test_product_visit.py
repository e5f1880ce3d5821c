"""bench/gpu/product_visit.py without a GPU: every config is a plan that vLLM 0.28.0's `vllm serve` parser takes, each
pool is what the plan leaves on a 24 GB card, the waves keep within the memory bound in first-fit priority order on
ports never reused, and the run (fake clock, fake servers) boots before it checks, checks before it measures at
length, and skips what its budget cannot fit, saying why."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qwen_serving import knobs as kn
from qwen_serving import memory, plan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import product_visit as pv  # noqa: E402
import scripted_mtp as sm  # noqa: E402

DRAFTER = Path("/tmp/drafter-for-test")


def _args(**more) -> argparse.Namespace:
    return argparse.Namespace(**{"base_port": 18100, "site": Path("/s"), "patched_site": Path("/p"), "python": "py",
                                 "ckpt": Path("/ckpt/raw"), "prepared_ckpt": Path("/ckpt/prepared"), "drafter": DRAFTER,
                                 "flashinfer_site": Path("/fi"), "quant_site": Path("/qs"), "plans": [], **more})


@pytest.fixture(scope="module")
def planned():  # as on a machine where FlashInfer is installed (flashinfer_missing found nothing)
    return pv.render(_args(), Path("/out"), None)


def test_every_config_is_a_plan_vllm_serve_parses(planned, vllm_cli):
    assert [p.vc.name for p in planned] == [c.name for c in pv.CONFIGS]
    for p in planned:
        assert p.refusal is None, (p.vc.name, p.refusal)
        ns, ea = vllm_cli.serve(p.cmd.argv)
        drafter = pv.served_drafter(_args(), p.vc)  # #19's W4A16 one for dflash2-w4a16, else the scripted drafter
        settings = kn.resolve(p.vc.mode, {**p.vc.knobs, **({"DRAFT": str(drafter)} if "SPEC" in p.vc.knobs else {})})
        assert ns.model_tag == str(pv.served_ckpt(_args(), p.vc))  # the fast variant for single-fast
        # the plan's own context length and pool: its pin for SPEC=dflash2, else what KV_MEM=auto leaves on 24 GB
        assert ea.max_model_len == settings["MAX_LEN"].value == pv.max_len(p), p.vc.name
        pin = settings["KV_MEM"].value
        assert ea.kv_cache_memory_bytes == p.served.kv_mem == (pin if pin != "" else pv.card_pool(p.vc)), p.vc.name
        assert ea.max_num_seqs == settings["MAX_SEQS"].value
        assert (ea.logprobs_mode == "raw_logits") == p.vc.raw_logits
        assert ("api" in p.vc.cheap) <= (not p.vc.raw_logits)  # api_smoke reads logprobs as log-probabilities
        assert ("--language-model-only" in p.cmd.argv) == (p.vc.knobs.get("VISION") != "1")
        spec = ea.speculative_config
        if p.spec == "dflash2":
            assert spec["method"] == "dflash" and spec["model"] == str(drafter)
            assert spec["num_speculative_tokens"] == settings["DFLASH_TOKENS"].value
            assert p.cmd.env[kn.LOOKUP_ENV] == str(settings["LOOKUP"].value)
        elif p.spec == "mtp":
            assert spec["num_speculative_tokens"] == settings["DRAFT_TOKENS"].value
        else:
            assert spec is None
    names = {p.vc.name: p for p in planned}
    assert names["mtp-huge"].served.value("CUDAGRAPH_MODE") == "PIECEWISE"
    assert [vllm_cli.serve(names[n].cmd.argv)[1].max_model_len for n in ("dflash2-huge", "mtp-huge")] == [245_760,
                                                                                                         262_144]


def test_a_refused_combination_is_recorded_not_forced(monkeypatch):
    bad = pv.VisitConfig("bad", "single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "LOOKUP": "0"}, ("#18",), "x")
    monkeypatch.setattr(pv, "CONFIGS", (*pv.CONFIGS[:1], bad))
    planned = pv.render(_args(), Path("/out"), None)
    assert planned[1].cmd is None and "LOOKUP=1" in planned[1].refusal
    rec = sm.Record(Path("/nonexistent/r.json"), {})
    pv.Visit(planned, rec, pv.Budget(0), None, None, None)
    assert any(s.startswith("bad: the plan refuses it:") for s in rec.data["skipped"])


def test_card_pool_is_the_plans_own_auto_pool(tmp_path):
    (tmp_path / kn.FAST_MODEL).mkdir(parents=True)
    (tmp_path / kn.FAST_MODEL / "config.json").write_text("{}")  # a single-user checkout after its first start
    card = plan.Probe(repo=tmp_path, free_vram=pv.CARD_FREE, total_vram=24 << 30, vram_source="test")
    for vc in pv.CONFIGS:
        built = plan.build(vc.mode, {**vc.knobs, "KV_MEM": "auto"}, probe=card)
        assert built.kv_mem == pv.card_pool(vc), vc.name


def test_waves_keep_within_the_bound_first_fit_in_priority_order(planned):
    waves = pv.pack(planned)
    flat = [p for w in waves for p in w]
    assert sorted(p.vc.name for p in flat) == sorted(p.vc.name for p in planned)
    ports = [p.port for p in planned]
    assert len(set(ports)) == len(ports)
    order = {p.vc.name: i for i, p in enumerate(planned)}
    for i, wave in enumerate(waves):
        assert sum(pv.memory_gib(p)["total"] for p in wave) <= pv.BOUND_GIB
        assert [order[p.vc.name] for p in wave] == sorted(order[p.vc.name] for p in wave)
        for p in wave:  # it is here because no earlier wave had room for it when its turn came
            for earlier in waves[:i]:
                before = sum(pv.memory_gib(q)["total"] for q in earlier if order[q.vc.name] < order[p.vc.name])
                assert before + pv.memory_gib(p)["total"] > pv.BOUND_GIB
    assert {p.vc.name for p in waves[0]} >= {"dflash2", "dflash2-k15", "dflash2-lookup0"}  # #18's group together
    # measured boot facts re-pack what is left: graphs that read large (vLLM's figure beside other booting servers)
    # leave room for fewer servers a wave
    seen = pv.memory_classes([(p, {"weights_gib": 14.6, "graph_capture_gib": 12.0}) for p in planned])
    assert len(pv.pack(planned, seen=seen)[0]) < len(waves[0])
    assert all(pv.memory_gib(p, seen)["graphs"] == 12.0 for p in planned)


def test_plans_picks_a_share_of_the_configs_on_their_own_ports(planned):
    share = pv.render(_args(plans=["dflash2-k15", "batch"]), Path("/out"), None)
    ports = {p.vc.name: p.port for p in planned}
    assert [(p.vc.name, p.port) for p in share] == [(n, ports[n]) for n in pv.NAMES if n in ("dflash2-k15", "batch")]
    with pytest.raises(SystemExit):
        pv.parse_args(["/o", "--dry-run", "--plans", "dflash2,no-such"])


def test_dry_run_prints_every_wave_and_the_parts_plan(tmp_path):
    # no FlashInfer site here: every config but the FlashInfer ones, and those listed as not tried, with why
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "product_visit.py"), str(tmp_path / "o"),
                          "--dry-run", "--drafter", str(DRAFTER), "--flashinfer-site", str(tmp_path / "fi"),
                          "--quant-site", str(tmp_path / "qs")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    names = re.findall(r"^# (\S+) \(port (\d+)", res.stdout, flags=re.M)
    flashinfer = [c.name for c in pv.CONFIGS if c.flashinfer]
    assert flashinfer == ["mtp-long"]
    variants = [c.name for c in pv.CONFIGS if c.variant]
    assert variants == ["single-fast", "dflash2-w4a16"]  # no quant site here either: #19's configs not tried
    assert sorted(n for n, _ in names) == sorted(c.name for c in pv.CONFIGS if not c.flashinfer and not c.variant)
    assert len({port for _, port in names}) == len(names)
    assert len(re.findall(r"^PYTHONPATH=/tmp/patched:/tmp/site .* serve ", res.stdout, flags=re.M)) == len(names)
    assert res.stdout.count("  parts: pool") == len(names) and "## expensive parts, in order (+: side by side): " in res.stdout
    assert "single:soak + batch:soak" in res.stdout
    assert "mtp-long:max_request" not in res.stdout
    assert res.stdout.count("# not tried:") == len(pv.NOT_TRIED) + 1 + 2 and not (tmp_path / "o").exists()
    for name in variants:
        assert re.search(rf"^# not tried: {name} \(.*\): the GPTQ quant site is not installed here: no "
                         rf"{tmp_path}/qs/{re.escape(pv.QUANT_MARKER)}", res.stdout, flags=re.M), name
    assert re.search(rf"^# not tried: mtp-long \(.*\): FlashInfer is not installed here: no {tmp_path}/fi/"
                     rf"{re.escape(pv.FLASHINFER_MARKER)}", res.stdout, flags=re.M)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _visit(planned, budget_s: float, boot_facts=None):
    """A Visit on a fake clock: a boot takes the estimate's seconds, each part its estimate; every call logged."""
    clock, calls, rec = FakeClock(), [], sm.Record(Path("/dev/null"), {})
    rec.save = lambda: None
    busy = []

    def boot(wave, limit):
        clock.now += min(limit, pv.BOOT_S["first" if not calls else "later"])
        calls.append(("boot", tuple(p.vc.name for p in wave)))
        return {p.vc.name: ("up", dict(boot_facts or {})) for p in wave}

    def measure(p, part, timeout):
        assert part in pv.SIDE_BY_SIDE or not busy, "two measurements at once"
        busy.append(part)
        assert timeout <= pv.limit_s(p, part)
        clock.now += pv.estimate_s(p, part) / (2 if part in pv.SIDE_BY_SIDE else 1)  # a pair's time, told twice
        calls.append((p.vc.name, part))
        busy.pop()
        return {"passed": True}

    visit = pv.Visit(planned, rec, pv.Budget(budget_s, clock), boot, measure, lambda wave: calls.append(("stop",)))
    visit.run()
    return calls, rec.data


def test_a_generous_budget_runs_everything_boots_first_then_cheap_then_expensive(planned):
    calls, data = _visit(planned, 100_000)
    assert not data["skipped"]
    waves = [c[1] for c in calls if c[0] == "boot"]
    assert [n for w in waves for n in w] and sorted(n for w in waves for n in w) == sorted(p.vc.name for p in planned)
    by_name = {p.vc.name: p for p in planned}
    for wave in waves:  # each wave: its boot, every cheap part, then its expensive parts in EXPENSIVE_ORDER, a stop
        at = calls.index(("boot", wave))
        end = calls.index(("stop",), at)
        parts = calls[at + 1:end]
        cheap = [(n, part) for n in wave for part in by_name[n].vc.cheap]
        steps = pv.expensive_steps(wave)
        assert [(n, part) for step in steps for n, part in step] == [e for e in pv.EXPENSIVE_ORDER if e[0] in wave]
        assert parts[:len(cheap)] == cheap
        done = parts[len(cheap):]
        for step in steps:  # a side-by-side step's parts in either order, the steps in order
            assert sorted(done[:len(step)]) == sorted(step)
            done = done[len(step):]
        assert done == []
    assert all(data["measurements"][p.vc.name]["pool"]["kv_mem"] == p.served.kv_mem for p in planned)


def test_a_short_budget_keeps_later_boots_and_says_what_it_skipped(planned):
    first = pv.pack(planned)[0]
    # room for the first wave's boot and cheap parts and the second wave's boot, not for any expensive part
    budget = pv.wave_need_s(first, True) + pv.BOOT_S["later"] + pv.STOP_S + 20
    calls, data = _visit(planned, budget)
    boots = [c for c in calls if c[0] == "boot"]
    assert len(boots) == 2 and boots[0][1] == tuple(p.vc.name for p in first)
    assert not [c for c in calls if c[0] != "boot" and len(c) == 2 and c[1] not in pv.CHEAP]  # no expensive part ran
    expensive = [s for s in data["skipped"] if "kept for later waves" in s or "s left" in s]
    assert any(s.startswith("dflash2-k15: quote25k (needs ~") for s in expensive)
    not_booted = [s for s in data["skipped"] if "not booted" in s]
    assert not_booted and not set(boots[1][1]) & {s.split(":")[0] for s in not_booted}
    # nothing at all fits: every server listed as not booted
    calls, data = _visit(planned, pv.BOOT_S["first"] - 1)
    assert calls == [] and len([s for s in data["skipped"] if "not booted" in s]) == len(planned)


def test_the_soaks_of_one_wave_run_at_once_and_say_so(planned):
    by = {p.vc.name: p for p in planned}
    assert [("single", "soak"), ("batch", "soak")] in pv.expensive_steps(["single", "batch"])
    assert [len(step) for step in pv.expensive_steps(["single"])] == [1, 1, 1, 1, 1]
    rec = sm.Record(Path("/dev/null"), {})
    rec.save = lambda: None
    together = threading.Barrier(2, timeout=10)  # passes only while both soaks are inside measure at once

    def measure(p, part, timeout):
        if part == "soak":
            together.wait()
            if p.vc.name == "batch":
                raise RuntimeError("the batch soak broke")
        return {"passed": True}

    visit = pv.Visit([by["single"], by["batch"]], rec, pv.Budget(100_000), lambda wave, limit: {
        p.vc.name: ("up", {}) for p in wave}, measure, lambda wave: None)
    visit.run()
    single = rec.data["measurements"]["single"]
    assert single["soak"] == {"passed": True, "side_by_side_with": ["batch"]}
    assert "soak" not in rec.data["measurements"]["batch"]
    assert rec.data["errors"] == {"batch: soak": "RuntimeError: the batch soak broke"}
    assert {"quality", "real_rep", "prefill_ab"} <= set(single)  # the single plan's other parts all ran
    # too little room for the pair: both listed as skipped, neither run
    rec = sm.Record(Path("/dev/null"), {})
    rec.save = lambda: None
    visit = pv.Visit([by["single"], by["batch"]], rec, pv.Budget(0), None, None, None)
    visit.parts_together([(by["single"], "soak"), (by["batch"], "soak")], reserve=0)
    assert [s.split(" (")[0] for s in rec.data["skipped"]] == ["single: soak", "batch: soak"]


def test_repacking_from_boot_facts_boots_fewer_a_wave(planned):
    calls, _ = _visit(planned, 100_000, boot_facts={"weights_gib": 15.0, "graph_capture_gib": 12.0})
    static = pv.pack(planned)
    boots = [c[1] for c in calls if c[0] == "boot"]
    # the first wave as the estimate packs it; the second holds fewer, its classes' graphs measured large
    assert boots[0] == tuple(p.vc.name for p in static[0]) and len(boots[1]) < len(static[1])


def test_judge_pins_identity_and_the_long_block(planned):
    facts = {p.vc.name: p for p in planned}
    data = {"servers": {n: {"state": "up"} for n in ("dflash2", "dflash2-lookup0", "dflash2-k15")},
            "measurements": {}}
    for name, tokens in (("dflash2", 69_369), ("dflash2-lookup0", 69_000)):
        data["measurements"][name] = {"pool": pv.pool_check(facts[name], {"kv_cache_tokens": tokens})}
    data["measurements"]["dflash2-k15"] = {"quote25k": {"passed": True, "summary": {"tokens_per_step": 12.5}}}
    checks = pv.judge(data, {}, None, [])
    assert checks["KV_MEM pinning: the same pool on two boots"]["passed"] is False
    assert checks["dflash2: pool tokens = memory model"]["passed"] == (pv.pool_prediction(facts["dflash2"]) == 69_369)
    assert checks["dflash2-k15: >= 13 tokens per step quoting 25k tokens"]["passed"] is False
    data["measurements"]["dflash2-k15"]["quote25k"]["summary"]["tokens_per_step"] = 13.2
    assert pv.judge(data, {}, None, [])["dflash2-k15: >= 13 tokens per step quoting 25k tokens"]["passed"]


def test_memory_estimates_follow_the_plan(planned):
    by = {p.vc.name: p for p in planned}
    assert pv.memory_gib(by["dflash2"])["pool"] == round(kn.KV_MEM_PINNED / memory.GiB, 2)
    assert pv.memory_gib(by["dflash2-huge"])["pool"] == round(kn.KV_MEM_PINNED_HUGE / memory.GiB, 2)
    assert pv.memory_gib(by["dflash2-vision"])["weights"] > pv.memory_gib(by["dflash2"])["weights"]
    assert dataclasses.replace(by["batch"]).spec == "off"


def test_the_run_wires_boot_measure_stop_and_the_report(tmp_path, monkeypatch):
    """pv.run end to end with its children faked: servers that come up at once with the predicted pool in their log,
    greedy answers that are visit 9's baseline (so every identity check has real traces), tools that pass."""
    import gzip
    import json

    from qwen_serving.checkpoint import scripted

    baseline = json.loads(gzip.decompress((pv.BASELINE_REPORT.with_suffix("") /
                                           f"{pv.BASELINE_SERVER}-greedy.json.gz").read_bytes()))
    design = argparse.Namespace(mtp_agree=sm.DEFAULT_AGREE)
    monkeypatch.setattr(scripted.Design, "read", staticmethod(lambda path: design))
    monkeypatch.setattr(sm, "make_checkpoint", lambda *a: {"draft_coverage": sm.DEFAULT_COVERAGE})
    monkeypatch.setattr(sm, "prepare_copy", lambda *a: {"steps_s": {}})
    monkeypatch.setattr(sm, "patch_state", lambda *a: {})
    monkeypatch.setattr(sm, "prompts_for", lambda d, kind, n: [{"ids": [i]} for i in range(n)])
    monkeypatch.setattr(sm, "expected_chain", lambda d, ids: baseline[ids[0]]["token_ids"])  # prompt i's answer
    monkeypatch.setattr(pv, "make_drafter", lambda *a: None)
    monkeypatch.setattr(pv, "flashinfer_missing", lambda *a: None)  # FlashInfer installed: mtp-long boots too
    monkeypatch.setattr(pv, "build_variants", lambda *a: {})  # #19's drafters built: their configs boot too
    rendered = {p.vc.name: p for p in pv.render(_args(), tmp_path, None)}
    stopped = []

    class FakeServer:
        def __init__(self, cfg, cmd, port, pythonpath, log_path):
            self.cfg, self.port, self.pythonpath, self.url = cfg, port, pythonpath, "u"
            self.name = cfg.name.removeprefix("product-")
            self.log_path, self.state = log_path, "new"
            self.proc = argparse.Namespace(pid=os.getpid())  # this test's own process tree stands for the server's
            log_path.write_text(f"GPU KV cache size: {pv.pool_prediction(rendered[self.name]):,} tokens\n")

        def start(self):
            self.state = "starting"

        def poll(self):
            self.state = "up" if self.state == "starting" else self.state
            return self.state

        def stop(self, grace_s=60):
            stopped.append(self.name)

        def log_text(self):
            return self.log_path.read_text()

        def log_tail(self, lines=60):
            return self.log_text()

    def part(ctx, p, url, name, timeout):
        if name == "greedy":
            return {"seconds": 1.0, "traces": baseline}
        return {"rc": 0, "passed": True, "summary": {"tokens_per_step": 13.5} if name == "quote25k" else None}

    monkeypatch.setattr(pv.run_full, "Server", FakeServer)
    monkeypatch.setattr(pv, "run_part", part)
    held = iter([{os.getpid(): 15_000}, {os.getpid(): 23_000}] + [{}] * 2 * len(rendered))  # first wave: boot, end
    monkeypatch.setattr(pv.run_full, "gpu_mib_by_pid", lambda: next(held))
    args = _args(out=tmp_path / "out", budget_s=100_000.0, dry_run=False)
    assert pv.run(args) == 0
    data = json.loads((tmp_path / "out" / pv.REPORT).read_text())
    assert data["passed"] and not data["errors"] and not data["skipped"]
    assert set(stopped) == set(rendered) and data["baseline"].startswith(pv.BASELINE_REPORT.name)
    checks = data["checks"]
    assert all(checks[f"{n}: boots"]["passed"] and checks[f"{n}: pool tokens = memory model"]["passed"] for n in rendered)
    assert checks["dflash2: greedy token-identical to scripted-patched-plain"]["passed"]
    assert checks["KV_MEM pinning: the same pool on two boots"]["passed"]
    assert (tmp_path / "out" / "dflash2-greedy.json").is_file()
    fits = {n: c for n, c in checks.items() if n.endswith("GPU memory fits a 24 GB card")}
    first = data["waves"][0]["servers"]
    assert set(fits) == {f"{n}: GPU memory fits a 24 GB card" for n in first}  # later waves: nvidia-smi listed none
    assert all(c["passed"] and c["boot"] == 15_000 and c["held_mib"] == 23_000 for c in fits.values())
    assert pv.judge({"servers": {"x": {"state": "up", "gpu_process_mib": {"end": 24_200}}}, "measurements": {}},
                    {}, None, [])["x: GPU memory fits a 24 GB card"]["passed"] is False


def test_a_server_fits_the_card_with_the_shipped_weights_in_place_of_the_loaded_ones():
    # a DFlash2 server on the scripted copy: 17.5 GiB loaded in two lines (target, bf16 drafter), shipped 15,000 MiB
    server = {"gpu_process_mib": {"boot": 24_000, "end": 25_000}, "boot_facts": {"weights_gib": [14.5, 3.0]},
              "shipped_weights_mib": 15_000}
    fit = pv.card_fit(server)
    assert fit["as_shipped_mib"] == 25_000 - 17_920 + 15_000 and fit["passed"]
    assert not pv.card_fit({**server, "shipped_weights_mib": 18_000})["passed"]  # 25,080 MiB > 24,166
    assert not pv.card_fit({**server, "boot_facts": {}})["passed"]  # no weights figure: the held figure alone
    assert pv.card_fit({"boot_facts": {"weights_gib": 14.5}}) is None  # not read yet


def test_the_shipped_weights_are_the_memory_models_for_each_plan(planned):
    by_name = {p.vc.name: p.vc for p in planned}
    assert pv.shipped_weights(by_name["single"]) == memory.weights_bytes("mtp", fast_variant=True)
    assert pv.shipped_weights(by_name["batch"]) == memory.weights_bytes("off", fast_variant=False)
    assert pv.shipped_weights(by_name["dflash2-vision"]) == memory.weights_bytes(
        "dflash2", vision=True, vision_offload_gib=kn.VISION_OFFLOAD_GIB)


def test_the_launcher_plans_serve_with_a_key_and_their_parts_send_it(planned, monkeypatch):
    keyed = {p.vc.name for p in planned if p.vc.api_key}
    assert keyed == {"single", "batch"}  # the soak's wrong- and missing-key kinds need a key set
    for p in planned:
        assert p.cmd.env.get(kn.SECRET_ENV) == (pv.VISIT_API_KEY if p.vc.name in keyed else None), p.vc.name
    argvs, clients = {}, []
    monkeypatch.setattr(pv, "tool", lambda ctx, name, part, argv, report, timeout: argvs.setdefault((name, part), argv))
    monkeypatch.setattr(sm, "measure_greedy", lambda client, model, prompts: clients.append(client.key))
    ctx = pv.Context(_args(), Path("/out"), {})
    for p in planned:
        if p.vc.name in ("single", "dflash2-vision"):
            for part in ("greedy", "api", "soak", "residue", "quote25k", "labd_soak", "max_request", "retrieval"):
                pv.run_part(ctx, p, "http://127.0.0.1:1", part, 300)
    assert clients == [pv.VISIT_API_KEY, None]
    for name, key in (("single", pv.VISIT_API_KEY), ("dflash2-vision", None)):
        for part in ("api", "soak", "residue", "quote25k", "labd_soak", "max_request", "retrieval"):
            argv = argvs[(name, part)]
            assert (argv[argv.index("--api-key") + 1] if "--api-key" in argv else None) == key, (name, part)
        soak = argvs[(name, "soak")]
        assert soak[soak.index("--server-log") + 1] == str(pv.server_log(Path("/out"), name))


def test_issue_22s_tools_run_on_the_single_user_plan_against_the_prepared_copy_and_the_batch_plan(planned, monkeypatch):
    argvs = {}
    monkeypatch.setattr(pv, "tool", lambda ctx, name, part, argv, report, timeout: argvs.setdefault(part, argv))
    single = next(p for p in planned if p.vc.name == "single")
    # first: the soaks' issue (#21) is done, these are not, and a visit that runs short drops the last parts
    assert [part for name, part in pv.EXPENSIVE_ORDER if name == "single"][:3] == ["quality", "real_rep", "prefill_ab"]
    ctx = pv.Context(_args(), Path("/out"), {})
    alone = pv.run_part(ctx, single, "http://127.0.0.1:1", "prefill_ab", 300)  # the batch plan is not up
    assert not alone["passed"] and "batch" in alone["error"] and "prefill_ab" not in argvs
    ctx.urls["batch"] = "http://127.0.0.1:2"
    for part in ("quality", "real_rep", "prefill_ab"):
        pv.run_part(ctx, single, "http://127.0.0.1:1", part, 300)
        assert argvs[part][argvs[part].index("--api-key") + 1] == pv.VISIT_API_KEY, part
    quality = argvs["quality"]
    assert quality[quality.index("--ckpt") + 1] == str(_args().prepared_ckpt)  # the closed form of what is served
    ab = argvs["prefill_ab"]
    assert ab[ab.index("--a-url") + 1] == "http://127.0.0.1:1" and ab[ab.index("--b-url") + 1] == "http://127.0.0.1:2"


def test_a_graph_figure_read_low_beside_other_boots_never_lowers_the_estimate(planned):
    seen = pv.memory_classes([(p, {"graph_capture_gib": -0.08}) for p in planned])
    assert all(pv.memory_gib(p, seen)["graphs"] == pytest.approx(pv.GRAPHS_GIB, abs=0.01) for p in planned)


def test_gpu_memory_is_read_per_process_and_summed_over_a_servers_tree():
    listing = "2059, 1200\n2838, 21000\n999, 40000\nnot a row\n"
    ran = lambda argv, **kw: argparse.Namespace(stdout=listing)  # noqa: E731
    held = pv.run_full.gpu_mib_by_pid(ran)
    assert held == {2059: 1200, 2838: 21000, 999: 40000}
    assert pv.run_full.server_gpu_mib([2059, 2838, 2839], held) == 22_200
    assert pv.run_full.server_gpu_mib([7, 8], held) is None
    assert pv.run_full.gpu_mib_by_pid(lambda argv, **kw: (_ for _ in ()).throw(OSError("no nvidia-smi"))) == {}


def test_the_memory_bound_follows_the_card_the_device_lends(planned):
    """An H100 (81,559 MiB) keeps the H200's headroom: single and batch still boot together, #18's three DFlash2
    servers and the single plan do not; the H200 and a silent nvidia-smi keep BOUND_GIB."""
    smi = lambda mib: lambda argv, **kw: argparse.Namespace(stdout=f"{mib}\n")  # noqa: E731
    h100 = pv.run_full.bound_gib(smi(81_559))
    assert h100 == pytest.approx(79.6 - pv.run_full.CARD_HEADROOM_GIB, abs=0.1)
    assert pv.run_full.bound_gib(smi(143_771)) == pv.BOUND_GIB
    assert pv.run_full.bound_gib(lambda argv, **kw: (_ for _ in ()).throw(OSError("no nvidia-smi"))) == pv.BOUND_GIB
    assert pv.run_full.bound_gib(smi("")) == pv.BOUND_GIB
    by = {p.vc.name: p for p in planned}
    assert len(pv.pack([by["single"], by["batch"]], h100)) == 1
    group = [by[n] for n in ("dflash2", "dflash2-k15", "dflash2-lookup0", "single")]
    assert len(pv.pack(group, h100)) > 1 and len(pv.pack(group)) == 1
    for wave in pv.pack(planned, h100):
        assert len(wave) == 1 or sum(pv.memory_gib(p)["total"] for p in wave) <= h100
    rec = sm.Record(Path("/dev/null"), {})
    rec.save = lambda: None
    booted = []
    visit = pv.Visit(group, rec, pv.Budget(100_000), lambda wave, limit: booted.append([p.vc.name for p in wave]) or {
        p.vc.name: ("up", {}) for p in wave}, lambda p, part, timeout: {"passed": True}, lambda wave: None, bound=h100)
    visit.run()
    assert len(booted) > 1 and sorted(n for w in booted for n in w) == sorted(p.vc.name for p in group)


def test_mtp_long_is_ctx_long_on_flashinfer_and_only_it_gets_flashinfers_site(planned, vllm_cli):
    """Issue #20 item 1: the plan's CTX=long with MTP, fp8 KV on FlashInfer at 150,000 tokens and 3 drafts, parsed by
    vLLM 0.28.0's own `vllm serve`; FlashInfer's site last on its PYTHONPATH and its bin (ninja) and the CUDA bin
    (nvcc) first on its PATH; the sampler stays off FlashInfer; parts: the pool check, greedy and the 150k request."""
    by = {p.vc.name: p for p in planned}
    p = by["mtp-long"]
    ns, ea = vllm_cli.serve(p.cmd.argv)
    assert (ea.kv_cache_dtype, ns.attention_backend) == ("fp8", "FLASHINFER")
    assert ea.max_model_len == 150_000 and ea.speculative_config["num_speculative_tokens"] == 3
    assert ea.speculative_config["method"] == "mtp" and ea.kv_cache_memory_bytes == pv.card_pool(p.vc)
    assert p.cmd.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert p.cmd.env["PATH"].split(os.pathsep)[:2] == ["/fi/bin", str(Path(os.environ.get("CUDA_HOME") or
                                                                            "/usr/local/cuda") / "bin")]
    args = _args()
    assert pv.server_pythonpath(args, p) == "/p:/s:/fi"
    assert all(pv.server_pythonpath(args, q) == "/p:/s" and "PATH" not in q.cmd.env
               for q in planned if q.vc.name != "mtp-long")
    assert pv.parts_for(p) == (["greedy"], ["max_request"])
    assert pv.estimate_s(p, "max_request") == 60 + 150_000 / pv.MAX_REQUEST_TOK_S
    assert pv.limit_s(p, "max_request") == 2 * pv.estimate_s(p, "max_request")
    assert pv.pool_prediction(p) == p.served.cache.pool_tokens(p.served.kv_mem, 150_000)
    # its wave's boot estimate and limit leave room for FlashInfer's JIT build; other waves' do not
    assert pv.boot_s([by["dflash2"], p], first=True) == pv.BOOT_S["first"] + pv.FLASHINFER_JIT_S
    assert pv.boot_s([by["dflash2"]], first=False) == pv.BOOT_S["later"]
    limits = []
    rec = sm.Record(Path("/dev/null"), {})
    rec.save = lambda: None
    visit = pv.Visit([by["dflash2"], p], rec, pv.Budget(100_000),
                     lambda wave, limit: limits.append((tuple(q.vc.name for q in wave), limit)) or {},
                     lambda *a: {}, lambda wave: None)
    visit.run()
    assert [limit for names, limit in limits if "mtp-long" in names] == [pv.LIMITS["boot"] + pv.FLASHINFER_JIT_S]


def test_without_flashinfer_mtp_long_is_not_planned_and_the_report_says_why(monkeypatch):
    why = "FlashInfer is not installed here: no /fi/.qs-flashinfer"
    planned = pv.render(_args(), Path("/out"), why)
    by = {p.vc.name: p for p in planned}
    assert by["mtp-long"].cmd is None and by["mtp-long"].unavailable == why
    assert all(p.cmd is not None and p.unavailable is None for p in planned if p.vc.name != "mtp-long")
    assert [v for k, v in pv.not_tried(planned).items() if k.startswith("mtp-long (")] == [why]
    calls, data = _visit(planned, 100_000)
    assert "mtp-long" not in {n for c in calls if c[0] == "boot" for n in c[1]}
    assert f"mtp-long: not planned: {why}" in data["skipped"]
    assert "mtp-long" not in data["measurements"]


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def test_flashinfer_missing_wants_the_marker_nvcc_ninja_and_the_import(tmp_path):
    site, fi = tmp_path / "site", tmp_path / "fi"
    site.mkdir()
    env = {"PATH": "/nonexistent", "CUDA_HOME": str(tmp_path / "cuda")}
    missing = lambda: pv.flashinfer_missing(sys.executable, site, fi, env)  # noqa: E731
    assert "no " + str(fi / pv.FLASHINFER_MARKER) in missing()
    fi.mkdir()
    (fi / pv.FLASHINFER_MARKER).write_text("flashinfer 0.6.16.post3\n")
    assert missing().startswith("no nvcc on the FlashInfer servers' PATH")
    _executable(tmp_path / "cuda" / "bin" / "nvcc")  # found through CUDA_HOME/bin, as the servers' PATH has it
    assert missing().startswith("no ninja on the FlashInfer servers' PATH")
    _executable(fi / "bin" / "ninja")
    (fi / "flashinfer").mkdir()
    (fi / "flashinfer" / "__init__.py").write_text("import pynvml_not_here\n")
    assert missing().endswith("ModuleNotFoundError: No module named 'pynvml_not_here'")
    (fi / "flashinfer" / "__init__.py").write_text("__version__ = '0.6.16.post3'\n")
    assert missing() is None


def test_pack_script_brings_back_the_visit_so_far_without_the_caches(tmp_path):
    """Each poll packs with --no-cache, so a machine lost mid-visit leaves the last poll's report and logs here."""
    visit, out = tmp_path / "visit", tmp_path / "out"
    (visit / "product-out").mkdir(parents=True)
    out.mkdir()
    (visit / "product-out" / "product-visit.json").write_text('{"phases_s": {}}')
    (visit / "product-out" / "single-soak.json").write_text("{}")
    (visit / "product-out" / "single.server.log").write_text("x" * 3_000_000)
    (visit / "visit.log").write_text("[visit] 1. patched copy\n")
    script = REPO / "tests" / "gpu" / "pack_product_visit.sh"
    env = {**os.environ, "QS_PACK_FROM": str(visit), "HOME": str(tmp_path / "no-caches-here")}
    done = subprocess.run(["bash", str(script), str(out), "--no-cache"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "product-visit.json", "product.tgz", "visit.tgz"]
    listing = subprocess.run(["tar", "-tzf", str(out / "product.tgz")], capture_output=True, text=True).stdout.split()
    assert "product-out/single-soak.json" in listing and "product-out/single.server.log" not in listing
    logs = subprocess.run(["tar", "-xzOf", str(out / "logs.tgz"), "pack-product-logs/single.server.log"],
                          capture_output=True).stdout
    assert len(logs) == 2_000_000  # the server log's tail only
    bad = subprocess.run(["bash", str(script), str(out), "--caches"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "only --no-cache" in bad.stderr


@pytest.fixture(scope="module")
def scripted_pair(tmp_path_factory) -> tuple[Path, Path]:
    from tests.helpers.tiny_checkpoint import make_scripted_with_drafter

    return make_scripted_with_drafter(tmp_path_factory.mktemp("variants"))


def test_the_variants_build_beside_their_sources_and_the_plans_serve_them(scripted_pair, tmp_path, vllm_cli):
    """#19's build on the CPU (round-to-nearest for GPTQ: the quant venv is not here; the CPU for CUDA): the fast
    variant passes prepare_status with the single-user plan's prepared steps, the W4A16 drafter is written, nothing
    of the sources changes, and the two configs serve what was built."""
    from tests.helpers.tiny_checkpoint import tree_state

    ckpt, drafter = scripted_pair
    before = (tree_state(ckpt), tree_state(drafter))
    args = _args(ckpt=ckpt, drafter=drafter, python=sys.executable)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    out.mkdir()
    done = pv.make_variants(args, env, out, pv.Budget(600), ["fast", "w4a16"], method="rtn", device="cpu", prompts=6)
    assert list(done["steps_s"]) == [step.name for step in pv.variant_steps(args, out, ["fast", "w4a16"])]
    assert "| `lm_head` |" in done["fast_error_table"] and "| `fc` |" in done["w4a16_error_table"]
    assert (tree_state(ckpt), tree_state(drafter)) == before
    status = subprocess.run([sys.executable, "-m", "qwen_serving.checkpoint.prepare_status", str(pv.fast_dir(args))],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    for line in ("PASS embed_tokens: int8", "PASS draft head:", "PASS fast variant: local rtn"):
        assert line in status.stdout, status.stdout
    assert (pv.w4a16_dir(args) / "config.json").is_file()
    again = pv.make_variants(args, env, out, pv.Budget(600), ["fast", "w4a16"], method="rtn", device="cpu", prompts=6)
    assert list(again["steps_s"]) == ["fast: quant_embed", "fast: build_draft_vocab"]  # built: only the no-op steps
    served = {p.vc.name: p for p in pv.render(args, out, None, {}) if p.vc.variant}
    assert vllm_cli.serve(served["single-fast"].cmd.argv)[0].model_tag == str(pv.fast_dir(args))
    assert served["single-fast"].cmd.env["VLLM_MTP_DRAFT_VOCAB"] == "1"  # the draft head the prepare step built
    assert vllm_cli.serve(served["dflash2-w4a16"].cmd.argv)[1].speculative_config["model"] == str(pv.w4a16_dir(args))


def test_gptq_runs_from_the_quant_site_and_the_rest_from_the_stack():
    steps = pv.variant_steps(_args(), Path("/out"), ["fast", "w4a16"])
    assert [(step.name, step.quant) for step in steps] == [
        ("fast: capture", False), ("fast: quantize", True), ("fast: quant_embed", False),
        ("fast: build_draft_vocab", False), ("w4a16: capture", False), ("w4a16: quantize", True)]
    assert all(s.argv[s.argv.index("--device") + 1] == "cuda" for s in steps if s.name.endswith("capture"))
    assert all(s.argv[s.argv.index("--method") + 1] == "gptq" for s in steps if s.name.endswith("quantize"))
    assert steps[1].argv[steps[1].argv.index("--out") + 1] == "/ckpt/raw-fast"
    assert steps[5].argv[:3] == ["drafter/quantize.py", str(DRAFTER), "--dflash2"]
    # a step is skipped once its product is there, except the idempotent prepare steps
    assert [s.made for s in steps] == [Path("/ckpt/raw-fast/config.json")] * 2 + [None] * 2 + [
        Path(f"{DRAFTER}-W4A16/config.json")] * 2
    shape = pv.variant_steps(_args(), Path("/out"), ["shape"])  # the random checkpoint GPTQ is measured on
    assert [(s.name, s.quant) for s in shape] == [("shape: synth", False), ("shape: capture", False),
                                                  ("shape: quantize", True)]
    assert shape[0].argv[:5] == ["-m", "qwen_serving.checkpoint.synth", "--size", "shape", "--layers"]
    assert shape[0].made == Path("/ckpt/qwen-shape-random/config.json")
    assert shape[2].argv[1] == "/ckpt/qwen-shape-random" and pv.variant_dir(_args(), "shape") == Path(
        "/ckpt/qwen-shape-random-fast")


def test_a_variant_that_fails_to_build_is_not_tried_and_leaves_the_other(tmp_path, monkeypatch):
    rec = sm.Record(tmp_path / pv.REPORT, {"phases_s": {}, "errors": {}})
    assert pv.build_variants(_args(), {}, tmp_path, pv.Budget(60), rec) == {
        v: pv.quant_missing(Path("/qs")) for v in ("fast", "w4a16")}
    assert pv.build_variants(_args(plans=["single"]), {}, tmp_path, pv.Budget(60), rec) == {}  # none wanted
    (tmp_path / "qs").mkdir()
    (tmp_path / "qs" / pv.QUANT_MARKER).touch()

    def make(args, env, out, budget, variants):
        built.append(variants)
        if variants == ["fast"]:
            raise sm.CheckpointError("fast: capture failed")
        return {"steps_s": {"w4a16: capture": 1.0}}

    built: list[list[str]] = []
    monkeypatch.setattr(pv, "make_variants", make)
    missing = pv.build_variants(_args(quant_site=tmp_path / "qs"), {}, tmp_path, pv.Budget(60), rec)
    assert missing == {"fast": "not built here: fast: capture failed"}
    assert rec.data["variants"] == {"w4a16": {"steps_s": {"w4a16: capture": 1.0}},
                                    "shape": {"steps_s": {"w4a16: capture": 1.0}}}  # the table serves no config
    assert built == [["fast"], ["w4a16"], ["shape"]]
    assert "fast: capture failed" in rec.data["errors"]["variants: fast"]
    planned = {p.vc.name: p for p in pv.render(_args(), Path("/out"), None, missing)}
    assert planned["single-fast"].cmd is None and planned["single-fast"].unavailable == missing["fast"]
    assert planned["dflash2-w4a16"].cmd is not None


def test_a_variants_greedy_acceptance_is_judged_against_its_sources_server():
    def server(per_position):
        return {"greedy": {"spec": {"per_position_acceptance": per_position}}}

    data = {"servers": {}, "measurements": {"single": server([0.76, 0.58, 0.44, 0.33]),
                                            "single-fast": server([0.75, 0.59, 0.43, 0.33]),
                                            "dflash2": server([0.9] * 7), "dflash2-w4a16": server([0.9] * 6 + [0.87])}}
    checks = pv.judge(data, {}, None, [])
    fast = checks["single-fast: greedy acceptance per position within 2% of single's"]
    assert fast["passed"] and fast["difference"] == [-0.01, 0.01, -0.01, 0.0]
    assert not checks["dflash2-w4a16: greedy acceptance per position within 2% of dflash2's"]["passed"]  # 3 points
    del data["measurements"]["single"]
    assert not any(name.startswith("single-fast: greedy acceptance") for name in pv.judge(data, {}, None, []))
    table = "#19: GPTQ below round-to-nearest on every matrix (random shape checkpoint, held-out rows)"
    rows = [{"module": "lm_head"}, {"module": "mtp.fc"}]
    for not_lower, passed in (([], True), (["mtp.fc"], False)):
        data["variants"] = {"shape": {"shape_held_out_error": rows, "shape_gptq_not_lower": not_lower}}
        assert pv.judge(data, {}, None, [])[table] == {"passed": passed, "not_lower": not_lower, "matrices": 2}
    data["variants"] = {"shape": {"shape_held_out_error": rows, "shape_gptq_not_lower": None}}  # rtn: no GPTQ
    assert table not in pv.judge(data, {}, None, [])


def test_the_quality_summary_keeps_the_check_and_what_the_forward_cost():
    data = {"check_passed": True, "scripted": {"check": {"relative_difference": 0.001}, "forward_s": 41.5,
                                               "forward_peak_gib": 12.3, "walks": [{"ids": [1, 2]}]}}
    assert pv.summarize_tool("quality", data) == {"check": {"relative_difference": 0.001}, "check_passed": True,
                                                  "forward_s": 41.5, "forward_peak_gib": 12.3}
    assert pv.summarize_tool("quality", {"check_passed": False})["forward_s"] is None  # the check never got there
