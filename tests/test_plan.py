"""The serve plan: every spec example's argv through vLLM 0.28.0's real `vllm serve` parser and
EngineArgs, one test per refusal rule, the API key kept out of the argv, and the CLI."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving import knobs, plan, vllm_028
from qwen_serving.plan import PlanError, Probe
from tests.helpers.fake_gpu import fake_nvidia_smi

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(tmp_path) -> Probe:
    """vLLM 0.28.0's facts and a repo with the drafter present."""
    drafter = tmp_path / knobs.DFLASH2_DRAFTER
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    return Probe(repo=tmp_path)


def parse(vllm_cli, argv: tuple[str, ...]):
    """Parse argv (starting `vllm serve`) like `vllm serve` does, then build EngineArgs."""
    assert argv[:2] == ("vllm", "serve")
    return vllm_cli.serve(list(argv[1:]))


EXAMPLES = [
    ("batch", {}),
    ("batch", {"PREFIX_CACHE": "0"}),
    ("batch", {"KV": "int4pth"}),
    ("batch", {"INT8_LAYERS": "."}),
    ("batch", {"INT8_ACT": "off"}),
    ("batch", {"REQ_METRICS": "1", "API_SERVERS": "2", "HOST": "0.0.0.0", "VLLM_API_KEY": "k"}),
    ("batch", {"GDN_PREFILL": "triton", "TP": "2", "EXTRA_ARGS": "--seed 1"}),
    ("single", {"SPEC": "dflash2", "TP": "4"}),
    *[("single", {"CTX": ctx, "SPEC": spec}) for ctx in ("fast", "long", "huge") for spec in ("mtp", "dflash2", "off")],
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}),
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "14", "CTX": "long"}),
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "CTX": "huge", "PREFIX_CACHE": "1"}),
    ("single", {"SPEC": "dflash2", "PREFIX_CACHE": "0"}),
    ("single", {"PREFIX_CACHE": "0"}),
    ("single", {"SPEC": "dflash2", "INT8_ACT": "int8"}),
    ("single", {"SPEC": "dflash2", "INT8_ACT": "int8", "INT8_LAYERS": "mlp", "PREFILL_ATTN": "int8"}),
    ("single", {"VISION": "1", "REQ_METRICS": "1"}),
    ("single", {"CTX": "huge", "CUDAGRAPH_MODE": "FULL_AND_PIECEWISE", "DRAFT_SAMPLE": "greedy", "TOOLS": "0"}),
    ("single", {"SPEC": "dflash2", "KV_MEM": "5.2GiB"}),
]


@pytest.mark.parametrize(("mode", "env"), EXAMPLES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'default'}"
                                                          for m, e in EXAMPLES])
def test_spec_examples_parse_through_vllm_serve(mode, env, probe, vllm_cli):
    p = plan.build(mode, env, probe)
    ns, ea = parse(vllm_cli, p.argv)
    s = {k: v.value for k, v in p.settings.items()}
    assert ea.max_num_seqs == s["MAX_SEQS"] and ea.max_model_len == s["MAX_LEN"]
    assert ea.host == s["HOST"] if hasattr(ea, "host") else ns.host == s["HOST"]
    assert ns.port == s["PORT"]
    assert ea.enable_prefix_caching is bool(s["PREFIX_CACHE"])
    assert ea.mamba_cache_mode == ("align" if s["PREFIX_CACHE"] else "none")
    assert ea.mamba_ssm_cache_dtype == "float16"
    assert ea.language_model_only is (not s["VISION"])
    assert ns.api_key is None  # the key never travels in the argv
    spec = s.get("SPEC", "off")
    if spec == "off":
        assert ea.speculative_config is None
    else:
        method = {"mtp": "mtp", "dflash2": "dflash"}[spec]
        k = s["DRAFT_TOKENS"] if spec == "mtp" else s["DFLASH_TOKENS"]
        assert ea.speculative_config["method"] == method and ea.speculative_config["num_speculative_tokens"] == k
    assert ea.async_scheduling is bool(s["ASYNC_SCHED"])
    if p.kv_mem is not None:
        assert ea.kv_cache_memory_bytes == p.kv_mem
    else:
        assert ea.gpu_memory_utilization == s["GPU_UTIL"]
    assert ea.tensor_parallel_size == int(env.get("TP", "1"))
    if "EXTRA_ARGS" in env:
        assert ea.seed == 1


def test_prefix_cache_0_turns_off_what_0_28_turns_on(probe, vllm_cli):
    """vLLM 0.28.0 enables prefix caching for hybrids by default: PREFIX_CACHE=0 must say no."""
    argv = plan.build("single", {"PREFIX_CACHE": "0"}, probe).argv
    assert "--no-enable-prefix-caching" in argv
    bare = [a for a in argv if a != "--no-enable-prefix-caching"]
    _, ea = parse(vllm_cli, tuple(bare))
    assert ea.enable_prefix_caching is None  # left to vLLM, which then turns it on for this model


def test_defaults_by_mode(probe):
    batch = plan.build("batch", {}, probe)
    assert batch.env == {"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}
    assert ("--kv-cache-dtype", "fp8") == batch.argv[batch.argv.index("--kv-cache-dtype"):][:2]
    single = plan.build("single", {}, probe)
    assert single.value("SPEC") == "mtp" and single.value("HOST") == "127.0.0.1"
    assert single.env["VLLM_SPEC_DECODE_ATTN"] == "1" and "VLLM_MARLIN_INPUT_DTYPE" not in single.env
    long = plan.build("single", {"CTX": "long"}, probe)
    assert long.value("DRAFT_TOKENS") == 3 and "FLASHINFER" in long.argv and "VLLM_SPEC_DECODE_ATTN" not in long.env
    huge = plan.build("single", {"CTX": "huge"}, probe)
    assert json.loads(huge.argv[huge.argv.index("--compilation-config") + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert huge.value("MAX_SEQS") == 2
    d = plan.build("single", {"SPEC": "dflash2"}, probe)
    assert d.kv_mem == knobs.KV_MEM_PINNED and "--no-async-scheduling" in d.argv
    lookup = {var: str(default) for var, _, default, _ in knobs.LOOKUP_PARAMS}  # read by dflash2-lookup.patch
    lookup[knobs.LOOKUP_STICKY] = "3"  # read by dflash2-verify-block.patch
    assert d.env == {"VLLM_SPEC_DECODE_ATTN": "1", "VLLM_DFLASH2_LOOKUP": "1", **lookup}
    assert plan.build("single", {"SPEC": "dflash2", "LOOKUP": "0"}, probe).env == {
        "VLLM_SPEC_DECODE_ATTN": "1", "VLLM_DFLASH2_LOOKUP": "0"}
    # the long verify block: the drafter's 7 plus the lookup's tail, async scheduling off, seats and context as the
    # memory model says; the hold reaches the patch
    long = plan.build("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}, probe)
    spec = json.loads(long.argv[long.argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 15 and "--no-async-scheduling" in long.argv
    assert long.env == d.env and long.value("MAX_SEQS") == 4 and long.value("MAX_LEN") == 57_344
    assert plan.build("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", knobs.LOOKUP_STICKY: "0"},
                      probe).env[knobs.LOOKUP_STICKY] == "0"


def test_every_automatic_adjustment_is_printed(probe):
    p = plan.build("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}, probe)
    text = "\n".join(p.notes)
    for adjusted in ("MAX_SEQS=4", "DFLASH_MAX_LEN=57344", "MAX_LEN=57344", "ASYNC_SCHED=0", "KV_MEM=5583457484"):
        assert adjusted in text
    b = plan.build("batch", {"INT8_LAYERS": "."}, probe)
    assert any("GPU_UTIL=0.95 because INT8_LAYERS=." in n for n in b.notes)


# ---- refusals: one per rule, each naming what to set instead ----
def refused(mode, env, probe, needle, **kw):
    with pytest.raises(PlanError) as e:
        plan.build(mode, env, probe, **kw)
    assert needle in str(e.value), str(e.value)
    return str(e.value)


def test_refuse_long_dflash_block_with_many_seats(probe):
    refused("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "MAX_SEQS": "8"}, probe, "set MAX_SEQS=4")
    assert plan.build("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "MAX_SEQS": "4"}, probe)


def test_refuse_dflash2_without_drafter(tmp_path):
    bare = Probe(repo=tmp_path)
    refused("single", {"SPEC": "dflash2"}, bare, "prepare/fetch_dflash2.py", require_files=True)
    dry = plan.build("single", {"SPEC": "dflash2"}, bare)  # a dry run says what first start fetches
    assert any(step.command.endswith("prepare/fetch_dflash2.py") for step in dry.missing)


def test_huge_is_vllms_own_int4_cache_at_the_whole_context(probe):
    for env, max_len in (({"CTX": "huge"}, 262_144), ({"CTX": "huge", "SPEC": "dflash2"}, 245_760),
                         ({"CTX": "huge", "SPEC": "dflash2", "DFLASH_TOKENS": "15"}, 203_776)):
        p = plan.build("single", env, probe)
        assert p.cache.kv_dtype == "int4_per_token_head" and p.value("MAX_LEN") == max_len
        assert p.argv[p.argv.index("--attention-backend") + 1] == "TRITON_ATTN"
        if p.kv_mem:  # the DFlash2 pools are pinned: one request of the whole context fits
            assert p.cache.fits(p.kv_mem, max_len)
    refused("batch", {"KV": "kvarn"}, probe, "'kvarn' is not one of fp8, int4pth")  # not built: not offered


def test_refuse_a_cache_the_vllm_does_not_take(probe):
    older = Probe(repo=probe.repo, kv_dtypes=vllm_028.KV_CACHE_DTYPES - {"int4_per_token_head"})
    msg = refused("single", {"CTX": "huge"}, older, "--kv-cache-dtype int4_per_token_head (CTX=huge")
    assert "is not a cache type vLLM 0.28.0 takes; set CTX=fast" in msg


def test_refuse_open_host_without_key(probe):
    msg = refused("single", {"HOST": "0.0.0.0"}, probe, "set VLLM_API_KEY")
    assert "HOST=127.0.0.1" in msg
    refused("batch", {"HOST": "192.168.1.20"}, probe, "api_key.txt")
    assert plan.build("single", {"HOST": "::1"}, probe).value("HOST") == "::1"
    assert plan.build("single", {"HOST": "0.0.0.0", "VLLM_API_KEY": "s3cret"}, probe)
    # in a container: 0.0.0.0 inside, published on the host's loopback (docker-compose.yml)
    inside = plan.build("single", {"HOST": "0.0.0.0", "PUBLISHED_ON": "127.0.0.1"}, probe)
    assert inside.value("HOST") == "0.0.0.0" and any("PUBLISHED_ON" in n for n in inside.notes)
    refused("single", {"HOST": "0.0.0.0", "PUBLISHED_ON": "0.0.0.0"}, probe, "PUBLISHED_ON=127.0.0.1")


def test_refuse_max_len_beyond_the_pool(probe):
    msg = refused("single", {"SPEC": "dflash2", "MAX_LEN": "131072"}, probe, "longest that fits")
    assert "lower MAX_LEN or raise KV_MEM" in msg
    refused("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "DFLASH_MAX_LEN": "65536"}, probe, "does not fit")
    # int8 per-token-head at 15: a 944-token attention block (16 x 59) leaves the drafter's window pages 16 tokens,
    # 257 of them a request: no context fits, whatever MAX_LEN says
    msg = refused("single", {"SPEC": "dflash2", "CTX": "long", "DFLASH_TOKENS": "15"}, probe, "no context fits")
    assert "blocks of 16 tokens" in msg and "set DFLASH_TOKENS=7" in msg and "lower MAX_LEN" not in msg
    assert plan.build("single", {"SPEC": "dflash2", "MAX_LEN": "131072", "KV_MEM": "10GiB"}, probe)


def test_refuse_more_seats_than_pool_blocks(probe):
    # batch plan shapes: 26.2 MB blocks (fp8 KV, fp16 state), so 1.5 GB hold 57 blocks < 64 seats
    msg = refused("batch", {"KV_MEM": "1500000000", "MAX_LEN": "8192"}, probe, "more than the 57 blocks")
    assert "lower MAX_SEQS or raise KV_MEM" in msg
    assert plan.build("batch", {"KV_MEM": "1500000000", "MAX_LEN": "8192", "MAX_SEQS": "57"}, probe)


@pytest.mark.parametrize(("env", "needle"), [
    ({"PORT": "http"}, "not an integer"),
    ({"PORT": "70000"}, "outside 1..65535"),
    ({"GPU_UTIL": "1.5"}, "not a fraction"),
    ({"GPU_UTIL": "most"}, "not a number"),
    ({"MAX_SEQS": "0"}, "outside 1.."),
    ({"CTX": "medium"}, "not one of fast, long, huge"),
    ({"SPEC": "eagle"}, "not one of mtp, dflash2, off"),
    ({"INT8_LAYERS": "mlp|("}, "not a regular expression"),
    ({"KV_MEM": "lots"}, "not a size"),
    ({"KV_MEM": "12M"}, "below 256 MiB"),
    ({"PREFIX_CACHE": "yes"}, "not 0 or 1"),
    ({"EXTRA_ARGS": "--served-model-name 'x"}, "cannot split"),
    ({"HOST": "a b"}, "not a host"),
    ({"DFLASH_TOKENS": "6"}, "outside 7..31"),
    ({"TOOL_PARSER": "qwen3_codr"}, "qwen3_coder"),
])
def test_refuse_malformed_values(env, needle, probe):
    msg = refused("single", env, probe, needle)
    knob = next(iter(env))
    assert knob in msg  # names the knob


def test_refuse_known_bad_combinations(probe):
    refused("single", {"INT8_ACT": "int8", "INT8_LAYERS": "mlp|linear_attn"}, probe, "INT8_LAYERS=mlp")
    refused("single", {"SPEC": "dflash2", "ASYNC_SCHED": "1"}, probe, "unset ASYNC_SCHED")
    refused("single", {"CTX": "long", "DRAFT_TOKENS": "4"}, probe, "DRAFT_TOKENS=3")
    # the int8 prefill hooks FlashAttention; CTX=long and huge serve on FlashInfer / Triton
    refused("single", {"CTX": "long", "PREFILL_ATTN": "int8", "INT8_ACT": "int8"}, probe, "set PREFILL_ATTN=off")
    refused("single", {"REQ_METRICS": "1", "EXTRA_ARGS": "--disable-log-stats"}, probe, "drop one")
    refused("single", {"EXTRA_ARGS": "--api-key abc"}, probe, "VLLM_API_KEY")
    refused("single", {"EXTRA_ARGS": "--tensor-parallel-size 2"}, probe, "set TP=2")


def test_ctx_long_caps_only_mtps_drafts(probe):
    def notes(spec):
        return [n for n in plan.build("single", {"CTX": "long", "SPEC": spec}, probe).notes if "DRAFT_TOKENS" in n]
    assert notes("dflash2") == notes("off") == []  # no MTP, nothing capped
    assert notes("mtp") and notes("mtp")[0].startswith("DRAFT_TOKENS=3 because SPEC=mtp, CTX=long: spec: k=4 dies")


@pytest.mark.parametrize("layers", ["mlp|linear_attn", "linear_attn|mlp", "linear_attn|mlp|mlp"])
def test_refuse_the_mlp_and_gdn_layer_set_in_any_order(layers, probe):
    msg = refused("batch", {"INT8_LAYERS": layers}, probe, "crashes inductor")
    assert f"INT8_LAYERS={layers}" in msg
    assert plan.build("batch", {"INT8_LAYERS": layers, "INT8_ACT": "off"}, probe)  # no int8: nothing to crash
    for fine in ("mlp", "mlp|linear_attn|self_attn", "linear_attn"):
        assert plan.build("batch", {"INT8_LAYERS": fine}, probe).env["VLLM_MARLIN_INT8_INCLUDE_RE"] == fine


def test_misspelt_knobs_are_named(probe):
    p = plan.build("single", {"SPEC": "dflash2", "VLLM_WSL_PIN_MEMORY": "1", "MAX_SEQ": "4", "DRAFT_TOKEN": "3",
                              "KV_MEMORY": "5G", "HOME": "/root", "PATH": "/bin", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
                   probe)
    text = "\n".join(p.warnings)
    assert "VLLM_WSL_PIN_MEMORY is set but is not a knob or a vLLM variable; did you mean " \
           "VLLM_WSL2_ENABLE_PIN_MEMORY?" in text
    assert "did you mean MAX_SEQS?" in text and "did you mean DRAFT_TOKENS?" in text and "KV_MEM?" in text
    assert "HOME" not in text and "PATH" not in text and "FLASHINFER" not in text
    b = plan.build("batch", {"SPEC": "dflash2"}, probe)
    assert any("SPEC is a single knob; batch mode ignores it" in w for w in b.warnings)


def test_rules_written_once_give_the_default_and_the_refusal(probe):
    """Each Limit is one datum: unset, the knob takes the bound; set past it, the same rule refuses or warns."""
    cases = [  # (mode, conditions, knob, a value past the bound, refused?)
        ("single", {"CTX": "long"}, "DRAFT_TOKENS", "4", True),
        ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}, "MAX_SEQS", "5", True),
        ("single", {"SPEC": "dflash2"}, "ASYNC_SCHED", "1", True),
        ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}, "LOOKUP", "0", True),
        ("single", {"CTX": "huge"}, "CUDAGRAPH_MODE", "FULL", False),
        ("batch", {"INT8_LAYERS": "."}, "GPU_UTIL", "0.97", False),
    ]
    limits = {k.name: rule for k in knobs.KNOBS for rule in k.defaults if isinstance(rule, knobs.Limit)}
    assert set(limits) == {knob for _, _, knob, _, _ in cases}
    for mode, env, knob, past, refuses in cases:
        default = plan.build(mode, env, probe)
        assert default.value(knob) == limits[knob].value and not default.warnings
        assert any(n.startswith(f"{knob}={limits[knob].value} because") for n in default.notes)
        if refuses:
            refused(mode, {**env, knob: past}, probe, f"{knob}=")
        else:
            assert any(f"{knob}={past}" in w for w in plan.build(mode, {**env, knob: past}, probe).warnings)


def test_dflash2_with_the_whole_vision_tower_on_the_card_warns(probe):
    p = plan.build("single", {"SPEC": "dflash2", "VISION": "1", "VISION_OFFLOAD": "0"}, probe)
    assert any("VISION_OFFLOAD=0 keeps the whole 0.858 GiB vision tower" in w for w in p.warnings)
    assert not plan.build("single", {"SPEC": "dflash2", "VISION": "1"}, probe).warnings  # offloaded by default


def test_wsl2_gets_pinned_memory_for_dflash2(probe):
    from dataclasses import replace

    p = plan.build("single", {"SPEC": "dflash2"}, replace(probe, wsl2=True))
    assert p.env["VLLM_WSL2_ENABLE_PIN_MEMORY"] == "1" and any("WSL2" in n for n in p.notes)
    assert "VLLM_WSL2_ENABLE_PIN_MEMORY" not in plan.build("single", {"SPEC": "mtp"}, replace(probe, wsl2=True)).env


# ---- the API key ----
def test_key_from_environment_never_printed(probe, capsys):
    p = plan.build("single", {"HOST": "0.0.0.0", "VLLM_API_KEY": "s3cret-key"}, probe)
    assert "s3cret-key" not in " ".join(p.argv) and "s3cret-key" not in "\n".join(p.export_lines())
    assert p.secret_env == {}  # vLLM reads VLLM_API_KEY from the environment it inherits


def test_key_from_file_goes_through_the_environment(probe):
    (probe.repo / "api_key.txt").write_text("file-key-123\n")
    p = plan.build("batch", {"HOST": "0.0.0.0"}, probe)
    assert p.secret_env == {"VLLM_API_KEY": "file-key-123"} and p.key_source == "api_key.txt"
    printed = "\n".join([*p.export_lines(), p.command_line(), *p.notes, *p.warnings])
    assert "file-key-123" not in printed
    assert 'export VLLM_API_KEY="$(head -n1 api_key.txt)"' in printed


def test_vllm_reads_the_key_from_the_environment():
    """vLLM 0.28.0: no --api-key -> envs.VLLM_API_KEY guards the server (api_server.py)."""
    from vllm.entrypoints.openai import api_server

    source = Path(api_server.__file__).read_text()
    assert "args.api_key or [envs.VLLM_API_KEY]" in source


# ---- memory facts in explain ----
def test_explain_reports_pool_and_seats(probe):
    p = plan.build("single", {"SPEC": "dflash2", "PREFIX_CACHE": "0"}, probe)
    lines = plan.explain_lines(p, probe)
    text = "\n".join(lines)
    assert "70,548 tokens at 65,536 max-model-len" in text
    assert "resident at 16,384-token prompts = 2 of MAX_SEQS=8" in text.replace("  ", " ").replace("  ", " ") \
        or "2 of MAX_SEQS=8 (the pool holds 2" in text
    assert "free VRAM" in text


def test_kv_mem_auto_uses_free_vram(probe):
    from dataclasses import replace

    refused("single", {"SPEC": "dflash2", "KV_MEM": "auto"}, probe, "KV_MEM=auto needs the free VRAM")
    card = replace(probe, free_vram=int(23.6 * (1 << 30)), total_vram=24 << 30, vram_source="test")
    p = plan.build("single", {"SPEC": "dflash2", "KV_MEM": "auto"}, card)
    assert 4.4 * (1 << 30) < p.kv_mem < 5.6 * (1 << 30)  # base checkpoint: int8 lm_head, 0.6 GiB more weights
    assert any(n.startswith("KV_MEM=auto ->") and "margin" in n for n in p.notes)
    # the base checkpoint (no fast variant) leaves less: the context shrinks to fit, and says so
    assert p.value("MAX_LEN") == 65536 and p.argv[p.argv.index("--max-model-len") + 1] != "65536"
    assert any(n.startswith("MAX_LEN=") and "KV_MEM=auto pool" in n for n in p.notes)
    refused("single", {"SPEC": "dflash2", "KV_MEM": "auto", "MAX_LEN": "65536"}, card, "longest that fits")


# ---- CLI ----
def run_cli(*args, env=None, cwd=REPO):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "qwen_serving.plan", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)


def test_dry_run_prints_exports_then_one_vllm_line():
    r = run_cli("single", "--dry-run", env={"SPEC": "dflash2", "DFLASH_TOKENS": "15"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert all(line.startswith("export ") for line in lines[:-1]) and lines[:-1]
    argv = shlex.split(lines[-1])
    assert argv[:2] == ["vllm", "serve"] and "--kv-cache-memory-bytes" in argv
    assert "note: MAX_SEQS=4 because SPEC=dflash2, DFLASH_TOKENS>7" in r.stderr


def test_dry_run_does_not_import_vllm():
    code = ("import sys, io, contextlib; from qwen_serving import plan\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    rc = plan.main(['single', '--dry-run'], env={})\n"
            "assert rc == 0 and 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == 0, r.stderr


def test_refusal_exits_2_and_names_the_fix():
    r = run_cli("batch", "--dry-run", env={"HOST": "0.0.0.0"})
    assert r.returncode == 2 and "refusing to start" in r.stderr and "VLLM_API_KEY" in r.stderr and not r.stdout


@pytest.fixture(scope="module")
def prepared_base(tmp_path_factory) -> Path:
    """A repo whose base checkpoint (the tiny synthetic one) went through prepare/build_draft_vocab.py."""
    tiny = tmp_path_factory.getbasetemp() / "synth-tiny-seed0"  # the path the prepare tests generate it at
    if not (tiny / "config.json").exists():
        synth = [sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "tiny", "--seed", "0", "--out", str(tiny)]
        subprocess.run(synth, check=True, cwd=REPO, capture_output=True, timeout=300)
    repo = tmp_path_factory.mktemp("repo")
    base = repo / knobs.BASE_MODEL
    shutil.copytree(tiny, base)
    (repo / "ids.json").write_text(json.dumps({"ids": [1, 2, 3]}))
    assert not (base / "prepared.json").exists()
    return repo


def test_a_prepared_draft_head_is_not_rebuilt(prepared_base):
    """The step the plan lists builds the head it looks for: run it, and the plan serves the head (export 1)."""
    probe, env = Probe(repo=prepared_base), {"MODEL": knobs.BASE_MODEL, "DRAFT_IDS": "ids.json"}
    before = plan.build("single", env, probe)
    [step] = [s for s in before.missing if "build_draft_vocab" in s.command]
    assert step.command == f"{plan.VENV_PYTHON} prepare/build_draft_vocab.py {knobs.BASE_MODEL} --ids ids.json"
    assert before.env["VLLM_MTP_DRAFT_VOCAB"] == "1"  # the step runs before vLLM starts
    argv = shlex.split(step.command.replace(plan.VENV_PYTHON, sys.executable, 1).replace("prepare/", f"{REPO}/prepare/"))
    subprocess.run(argv, check=True, capture_output=True, timeout=300, cwd=prepared_base)
    recorded = json.loads((prepared_base / knobs.BASE_MODEL / "prepared.json").read_text())["steps"]
    assert list(recorded) == ["draft_vocab"]
    after = plan.build("single", env, probe)
    assert not any("build_draft_vocab" in s.command for s in after.missing)
    assert any("quant_lm_head" in s.command for s in after.missing)
    assert after.env["VLLM_MTP_DRAFT_VOCAB"] == "1" and "MTP draft head" in {d.name for d in after.derived}


# ---- the draft vocabulary never blocks a start ----
def draft_steps(p: plan.ServePlan) -> list[str]:
    return [s.command for s in p.missing if "build_draft_vocab" in s.command]


def test_no_list_serves_the_full_head_and_names_the_calibration(tmp_path):
    p = plan.build("single", {}, Probe(repo=tmp_path))
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "0" and not draft_steps(p)
    [note] = [n for n in p.notes if n.startswith("MTP_DRAFT_VOCAB=0 because")]
    assert "full lm_head" in note and plan.CALIBRATE in note
    assert p.settings["MTP_DRAFT_VOCAB"].source == "plan"
    assert any("set by the plan" in line and line.startswith("MTP_DRAFT_VOCAB")
               for line in plan.explain_lines(p, Probe(repo=tmp_path)))
    assert "single-user/calibrate.sh" in plan.CALIBRATE and (REPO / "single-user" / "calibrate.sh").is_file()


def test_the_list_in_the_checkout_builds_the_head_on_first_start(tmp_path):
    (tmp_path / "prepare").mkdir()
    (tmp_path / knobs.DRAFT_IDS).write_text(json.dumps({"ids": [1, 2]}))
    p = plan.build("single", {}, Probe(repo=tmp_path))
    # MODEL=auto: the head goes into the fast variant, after the step that fetches it
    assert draft_steps(p) == [f"venv/bin/python prepare/build_draft_vocab.py {knobs.FAST_MODEL} --ids {knobs.DRAFT_IDS}"]
    commands = [s.command for s in p.missing]
    assert commands.index(draft_steps(p)[0]) == commands.index("venv/bin/python prepare/fetch_fast_variant.py") + 1
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "1" and any("the list in this checkout" in n for n in p.notes)


def test_draft_ids_changes_the_step(tmp_path):
    (tmp_path / "mine.json").write_text("[5, 6]")
    p = plan.build("single", {"DRAFT_IDS": "mine.json"}, Probe(repo=tmp_path))
    assert draft_steps(p) == [f"venv/bin/python prepare/build_draft_vocab.py {knobs.FAST_MODEL} --ids mine.json"]
    assert any("mine.json (DRAFT_IDS)" in n for n in p.notes)
    refused("single", {"DRAFT_IDS": "nope.json"}, Probe(repo=tmp_path), "DRAFT_IDS=nope.json does not exist")


def test_a_head_in_the_served_checkpoint_is_used(tmp_path):
    fast = tmp_path / knobs.FAST_MODEL
    fast.mkdir(parents=True)
    (fast / "config.json").write_text(json.dumps({"draft_vocab": {"size": 2, "ids_file": "draft_vocab_ids.json"}}))
    p = plan.build("single", {}, Probe(repo=tmp_path))
    assert p.env["VLLM_MTP_DRAFT_VOCAB"] == "1" and not draft_steps(p) and p.served == knobs.FAST_MODEL


def test_explicit_mtp_draft_vocab_without_head_or_list_is_refused(tmp_path):
    msg = refused("single", {"MTP_DRAFT_VOCAB": "1"}, Probe(repo=tmp_path), "unset MTP_DRAFT_VOCAB")
    assert plan.CALIBRATE in msg and "DRAFT_IDS=" in msg
    (tmp_path / "ids.json").write_text("[1]")  # with a list it is built
    assert draft_steps(plan.build("single", {"MTP_DRAFT_VOCAB": "1", "DRAFT_IDS": "ids.json"}, Probe(repo=tmp_path)))


def test_no_draft_head_step_where_it_is_not_used(tmp_path):
    (tmp_path / "ids.json").write_text("[1]")
    for env in ({"MTP_DRAFT_VOCAB": "0"}, {"SPEC": "dflash2"}, {"SPEC": "off"}):
        p = plan.build("single", {**env, "DRAFT_IDS": "ids.json"}, Probe(repo=tmp_path))
        assert not draft_steps(p) and not any("MTP_DRAFT_VOCAB=0 because" in n for n in p.notes), env
    assert plan.build("single", {"MTP_DRAFT_VOCAB": "0"}, Probe(repo=tmp_path)).env["VLLM_MTP_DRAFT_VOCAB"] == "0"


# ---- explicit paths, and the same answer before and after install ----
@pytest.mark.parametrize(("mode", "env", "needle"), [
    ("single", {"MODEL": "/no/such/dir"}, "MODEL=/no/such/dir does not exist"),
    ("batch", {"MODEL": "models/elsewhere"}, "MODEL=models/elsewhere does not exist"),
    ("batch", {"MODEL": knobs.FAST_MODEL}, "does not exist"),  # batch's first start does not fetch it
    ("single", {"SPEC": "dflash2", "DRAFT": "/no/drafter"}, "DRAFT=/no/drafter does not exist"),
    ("single", {"DRAFT": "/no/drafter"}, "DRAFT=/no/drafter does not exist"),
])
def test_an_explicit_path_that_does_not_exist_is_refused_at_once(tmp_path, mode, env, needle):
    refused(mode, env, Probe(repo=tmp_path, vllm_installed=False), needle)
    r = run_cli(mode, "--missing", env=env)  # the first thing start_server.sh runs: nothing else has run yet
    assert r.returncode == 2 and needle in r.stderr and not r.stdout


@pytest.mark.parametrize(("mode", "env"), [
    ("single", {"MODEL": knobs.BASE_MODEL}), ("single", {"MODEL": knobs.FAST_MODEL}), ("single", {"MODEL": "auto"}),
    ("batch", {"MODEL": knobs.BASE_MODEL}), ("single", {"SPEC": "dflash2", "DRAFT": knobs.DFLASH2_DRAFTER}),
])
def test_the_default_dirs_first_start_creates_may_be_absent(tmp_path, mode, env):
    p = plan.build(mode, env, Probe(repo=tmp_path, vllm_installed=False))
    assert p.missing[0].command == "bash install.sh" and any("download.py" in s.command for s in p.missing)


def test_a_path_the_caller_creates_may_be_absent(tmp_path):
    assert plan.build("batch", {"MODEL": "/ckpt/x"}, Probe(repo=tmp_path), will_create={"/ckpt/x"})


@pytest.mark.parametrize(("mode", "env"), [("batch", {"KV": "kvarn"}), ("single", {"CTX": "huge"}),
                                           ("single", {"SPEC": "dflash2", "CTX": "huge"}),
                                           ("single", {"TOOL_PARSER": "qwen3_codr"}), ("batch", {}), ("single", {}),
                                           ("single", {"SPEC": "dflash2"}), ("batch", {"VLLM_MARLN_INPUT_DTYPE": "1"})])
def test_the_plan_answers_the_same_before_and_after_install(tmp_path, mode, env):
    def answer(installed: bool):
        try:
            p = plan.build(mode, env, Probe(repo=tmp_path, vllm_installed=installed))
        except PlanError as e:
            return str(e)
        return p.argv, dict(p.env), p.notes, p.warnings, [s for s in p.missing if s.command != "bash install.sh"]

    before, after = answer(False), answer(True)
    assert before == after
    if env.get("KV") == "kvarn":
        assert isinstance(before, str) and "'kvarn' is not one of" in before
    if env.get("CTX") == "huge":
        assert not isinstance(before, str) and "int4_per_token_head" in before[0]
    if "TOOL_PARSER" in env:
        assert isinstance(before, str) and "did you mean qwen3_coder" in before


def test_probe_detect_reads_no_vllm(tmp_path):
    """Probe.detect takes vLLM's names from vllm_028 whatever is installed; only the entry point is looked for."""
    p = Probe.detect(tmp_path)
    assert (p.kv_dtypes, p.tool_parsers, p.vllm_env) == (vllm_028.KV_CACHE_DTYPES, vllm_028.TOOL_PARSERS,
                                                         vllm_028.ENV_NAMES)


def test_the_frozen_facts_are_vllm_0_28_0s(pristine_vllm):
    """vllm_028's lists are the pristine 0.28.0's own (the tests' venv), so they cannot drift from the pin."""
    import re

    assert (pristine_vllm / "_version.py").read_text().count(f"'{vllm_028.VERSION}'") or \
        f'"{vllm_028.VERSION}"' in (pristine_vllm / "_version.py").read_text()
    cache = (pristine_vllm / "config" / "cache.py").read_text()
    literal = re.search(r"^CacheDType = Literal\[(.*?)\]", cache, re.S | re.M).group(1)
    assert vllm_028.KV_CACHE_DTYPES == set(re.findall(r'"([^"]+)"', literal))
    parsers = (pristine_vllm / "tool_parsers" / "__init__.py").read_text()
    assert vllm_028.TOOL_PARSERS == set(re.findall(r'^    "([a-z0-9_]+)": \(', parsers, re.M))
    from vllm import envs  # the pristine or the patched copy: the patches add names, never remove one

    stock = set(re.findall(r'^    "(VLLM_[A-Z0-9_]+)":', (pristine_vllm / "envs.py").read_text(), re.M))
    assert vllm_028.ENV_NAMES == stock and stock <= set(envs.environment_variables)
    assert {"kvarn", "fp8", "int4_per_token_head"} & vllm_028.KV_CACHE_DTYPES == {"fp8", "int4_per_token_head"}


def test_explain_says_what_is_not_checked_yet(tmp_path):
    probe = Probe(repo=tmp_path, vllm_installed=False)
    text = "\n".join(plan.explain_lines(plan.build("single", {}, probe), probe))
    section = text.split("# not checked yet\n", 1)[1].splitlines()
    assert [line.split("=")[0].strip() for line in section] == ["vLLM install", "GPU and free VRAM", "checkpoint contents"]
    assert all("not checked yet" in line for line in section) and "verify.sh" in section[0]


def test_start_server_refuses_before_the_install(tmp_path):
    """start_server.sh asks the plan first: a refused configuration runs no step, install.sh included."""
    repo = tmp_path / "checkout"
    shutil.copytree(REPO / "qwen_serving", repo / "qwen_serving", ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "installed"
    (repo / "install.sh").write_text(f"touch {marker}\n")
    no_vllm = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "vllm").exists()]
    env = {"PATH": os.pathsep.join(no_vllm), "MODEL": "/no/such/dir"}
    r = subprocess.run(["bash", str(repo / "qwen_serving" / "start_server.sh"), "single"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "MODEL=/no/such/dir does not exist" in r.stderr and not marker.exists()
    del env["MODEL"]  # the same checkout with a fine configuration, on a 3090, does reach the install step
    env["PATH"] = os.pathsep.join([str(fake_nvidia_smi(tmp_path / "fake-gpu")), env["PATH"]])
    r = subprocess.run(["bash", str(repo / "qwen_serving" / "start_server.sh"), "single"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert marker.exists() and "step 1/" in r.stdout and "bash install.sh" in r.stdout


def test_missing_lists_first_start_commands(tmp_path):
    r = run_cli("single", "--missing", env={"SPEC": "dflash2"})
    assert r.returncode == 0
    commands = r.stdout.splitlines()
    if not (REPO / knobs.BASE_MODEL / "config.json").exists():
        assert "venv/bin/python prepare/download.py" in commands
    if not (REPO / knobs.DFLASH2_DRAFTER / "config.json").exists():
        assert commands[-1] == "venv/bin/python prepare/fetch_dflash2.py"
