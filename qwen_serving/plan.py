"""The serve plan: environment -> ServePlan (vllm argv + exported variables) for `batch` and `single`.

    python -m qwen_serving.plan {batch,single} --dry-run   export lines, then the `vllm serve` line
    python -m qwen_serving.plan {batch,single} explain     every derived value and the rule that set it
    python -m qwen_serving.plan {batch,single} --missing   first-start steps still to run, one command a line
    python -m qwen_serving.plan {batch,single} run         validate, then exec vllm (what start_qwen.sh does)

Standard library only and never imports vllm: it runs before install.sh and on machines without a GPU.
Notes (every automatic adjustment) and warnings go to stderr; a refusal exits 2 and names what to set.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import dotenv, knobs, memory
from .knobs import BASE_MODEL, FAST_MODEL, KNOBS, KnobError, Setting

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "qwen3.8-27b"
VENV_PYTHON = "venv/bin/python"
API_KEY_FILE = "api_key.txt"
VISION_MAX_PIXELS = 2048 * 32 * 32  # 2048 image tokens of 32x32 pixels (16-pixel patches, 2x2 merge)
HUGE_KV = "kvarn"  # the long-context cache dtype CTX=huge and KV=kvarn ask for (added by kvarn/install.sh)
# VLLM_* names our patches read beside the knobs' own (for the misspelling check).
PATCH_ENV = ("VLLM_DFLASH2_DRAFT_TOPK_TOPP", "VLLM_DFLASH2_TORCH_TOPK", "VLLM_V2_CUDAGRAPH_MEM_MIB",
             "VLLM_VISION_CPU_OFFLOAD_GB", "VLLM_MARLIN_TUNE", "VLLM_SMALL_TOPK_SAMPLER")
# vLLM names this module refers to, for when no vllm is installed to read the full list from.
KNOWN_VLLM_ENV = ("VLLM_API_KEY", "VLLM_WSL2_ENABLE_PIN_MEMORY", "VLLM_USE_FLASHINFER_SAMPLER",
                  "VLLM_DISABLED_KERNELS", "VLLM_FLASH_ATTN_VERSION", "VLLM_TARGET_DEVICE")


class PlanError(ValueError):
    """A configuration that must not boot; the message says what to set instead."""


@dataclass(frozen=True)
class Probe:
    """Facts about this machine that the plan depends on, read without importing vllm."""

    repo: Path = REPO
    vllm_dir: Path | None = None
    kv_dtypes: frozenset[str] = frozenset()  # empty: vllm not found, so not checked
    vllm_env: frozenset[str] = frozenset(KNOWN_VLLM_ENV)
    tool_parsers: frozenset[str] = frozenset()
    free_vram: int | None = None
    total_vram: int | None = None
    vram_source: str = "not read"
    wsl2: bool = False
    vllm_installed: bool = True  # the serving venv has a vllm entry point

    @classmethod
    def detect(cls, repo: Path = REPO, read_gpu: bool = False, vllm_dir: Path | None = None) -> Probe:
        """vllm_dir: the vllm package to read (default: the one Python would import, else the repo's venv)."""
        vllm_dir = vllm_dir or _find_vllm(repo)
        kv, names, parsers = frozenset(), frozenset(KNOWN_VLLM_ENV), frozenset()
        if vllm_dir:
            kv = _literal_values(vllm_dir / "config" / "cache.py", "CacheDType")
            names = names | _dict_keys(vllm_dir / "envs.py", r'^    "(VLLM_[A-Z0-9_]+)":')
            parsers = _dict_keys(vllm_dir / "tool_parsers" / "__init__.py", r'^    "([a-z0-9_]+)": \(')
        free = total = None
        source = "not read (explain and KV_MEM=auto read it)"
        if read_gpu:
            free, total, source = read_vram()
        try:
            wsl2 = "microsoft" in Path("/proc/version").read_text().lower()
        except OSError:
            wsl2 = False
        installed = (repo / "venv" / "bin" / "vllm").exists() or shutil.which("vllm") is not None
        return cls(repo, vllm_dir, kv, names, parsers, free, total, source, wsl2, installed)


def _find_vllm(repo: Path) -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without running it
    if spec and spec.origin:
        return Path(spec.origin).parent
    for site in sorted((repo / "venv" / "lib").glob("python3*/site-packages/vllm")):
        return site
    return None


def _literal_values(path: Path, name: str) -> frozenset[str]:
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    match = re.search(rf"^{name} = Literal\[(.*?)\]", text, re.S | re.M)
    return frozenset(re.findall(r'"([^"]+)"', match.group(1))) if match else frozenset()


def _dict_keys(path: Path, pattern: str) -> frozenset[str]:
    try:
        return frozenset(re.findall(pattern, path.read_text(), re.M))
    except OSError:
        return frozenset()


def read_vram() -> tuple[int | None, int | None, str]:
    """Free and total bytes of GPU 0: torch if it sees CUDA, else nvidia-smi, else (None, None, why)."""
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(0)
            return int(free), int(total), "torch.cuda.mem_get_info"
    except Exception:  # torch absent or broken: fall through to nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=20, check=True).stdout
            free, total = (int(x) * memory.MiB for x in out.strip().split(","))
            return free, total, "nvidia-smi"
        except (subprocess.SubprocessError, ValueError):
            return None, None, "nvidia-smi failed"
    return None, None, "cannot read free VRAM: no CUDA torch and no nvidia-smi"


@dataclass(frozen=True)
class Derived:
    name: str
    value: object
    why: str


@dataclass(frozen=True)
class Step:
    """A first-start step: a resumable command that is a no-op once done."""

    what: str
    command: str


@dataclass(frozen=True)
class ServePlan:
    mode: str
    settings: Mapping[str, Setting]
    argv: tuple[str, ...]
    env: Mapping[str, str]
    secret_env: Mapping[str, str] = field(repr=False, default_factory=dict)
    key_source: str = ""
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    derived: tuple[Derived, ...] = ()
    missing: tuple[Step, ...] = ()
    cache: memory.CacheShape | None = None
    kv_mem: int | None = None

    def value(self, name: str) -> object:
        return self.settings[name].value

    def export_lines(self) -> list[str]:
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        if self.key_source == API_KEY_FILE:
            lines.append(f'export VLLM_API_KEY="$(head -n1 {API_KEY_FILE})"')
        return lines

    def command_line(self) -> str:
        return shlex.join(self.argv)


def _api_key(env: Mapping[str, str], repo: Path) -> tuple[str, str]:
    if env.get("VLLM_API_KEY"):
        return env["VLLM_API_KEY"], "VLLM_API_KEY"
    path = repo / API_KEY_FILE
    if path.is_file():
        first = path.read_text().strip().splitlines()
        if first and first[0].strip():
            return first[0].strip(), API_KEY_FILE
    return "", ""


def misspelt(env: Mapping[str, str], mode: str, probe: Probe) -> list[str]:
    """Warnings for set variables that are not ours or vLLM's but look like one of them."""
    ours = {k.name for k in KNOBS} | {k.env for k in KNOBS if k.env}
    known = ours | set(probe.vllm_env) | set(PATCH_ENV) | {"VLLM_API_KEY"}
    out = []
    for name in sorted(env):
        if name in known or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        if close:
            out.append(f"{name} is set but is not a knob or a vLLM variable; did you mean {close[0]}?")
    for k in KNOBS:
        if env.get(k.name) and mode not in k.modes:
            out.append(f"{k.name} is a {'/'.join(k.modes)} knob; {mode} mode ignores it")
    return out


def _first_start_steps(mode: str, s: Mapping[str, object], model: str, probe: Probe) -> list[Step]:
    repo, py = probe.repo, VENV_PYTHON
    steps = []
    if not probe.vllm_installed:
        steps.append(Step("install the pinned, patched vLLM into venv/", "bash install.sh"))
    base = repo / BASE_MODEL
    if model in (BASE_MODEL, FAST_MODEL):
        done = _manifest_steps(base)
        if not (base / "config.json").is_file():
            steps.append(Step("download the W4A16 checkpoint (~19.5 GB, resumable)", f"{py} prepare/download.py"))
        for name, what in (("quant_lm_head", "lm_head to int8"), ("quant_embed", "embed_tokens to int8"),
                           ("quant_mtp", "the MTP module to int8")):
            if name not in done:
                steps.append(Step(f"requantize {what} (CPU, minutes)", f"{py} prepare/{name}.py {BASE_MODEL}"))
        if mode == "single" and "build_draft_vocab" not in done:
            steps.append(Step("build the 40k-token MTP draft head",
                              f"{py} prepare/build_draft_vocab.py {BASE_MODEL} --ids prepare/draft_vocab_ids.json"))
        if mode == "single" and not (repo / FAST_MODEL / "config.json").is_file():
            steps.append(Step("fetch the fast variant (~1 GB: int4 lm_head + MTP)", f"{py} prepare/fetch_fast_variant.py"))
    if s.get("SPEC") == "dflash2" and s.get("DRAFT") == knobs.DFLASH2_DRAFTER:
        if not (repo / knobs.DFLASH2_DRAFTER / "config.json").is_file():
            steps.append(Step("fetch the W4A16 DFlash2 drafter (1.2 GB)", f"{py} prepare/fetch_dflash2.py"))
    return steps


def _manifest_steps(model_dir: Path) -> set[str]:
    """Step names recorded in prepare/'s prepared.json (each step is also a no-op when re-run)."""
    try:
        data = json.loads((model_dir / "prepared.json").read_text())
    except (OSError, ValueError):
        return set()
    steps = data.get("steps", data) if isinstance(data, dict) else data
    names = set(steps) if isinstance(steps, dict) else set()
    if isinstance(steps, list):
        for item in steps:
            if isinstance(item, dict):
                names.update(str(item.get(k, "")) for k in ("step", "script", "name"))
    return {Path(n).stem for n in names if n}


def build(mode: str, env: Mapping[str, str], probe: Probe | None = None, require_files: bool = False) -> ServePlan:
    """Resolve knobs, validate, derive the argv and the exports. Raises PlanError on a refusal."""
    probe = probe or Probe.detect()
    try:
        settings = knobs.resolve(mode, env)
    except KnobError as e:
        raise PlanError(str(e)) from None
    s = {k: v.value for k, v in settings.items()}
    explicit = {k for k, v in settings.items() if v.source == "env"}
    notes, warnings = [], misspelt(env, mode, probe)
    derived: list[Derived] = []

    def note_defaults() -> None:
        for name, setting in settings.items():
            if setting.source == "default" and setting.rule is not None and setting.rule.when:
                cond = setting.rule.describe()
                if cond:
                    why = f": {setting.rule.why}" if setting.rule.why else ""
                    notes.append(f"{name}={setting.value} because {cond}{why}")

    note_defaults()
    spec = s.get("SPEC", "off")
    ctx = s.get("CTX", "fast")

    # ---- model dir ----
    model = s["MODEL"]
    if model == "auto":
        model = FAST_MODEL if (probe.repo / FAST_MODEL / "config.json").is_file() else BASE_MODEL
        if model == BASE_MODEL:
            notes.append(f"MODEL={BASE_MODEL}: the fast variant is not there yet (prepare/fetch_fast_variant.py)")
        derived.append(Derived("MODEL", model, "single: the fast variant if present, else the base requantization"))
    missing = _first_start_steps(mode, s, model, probe)
    if "MODEL" in explicit and not (probe.repo / model).exists() and not Path(model).exists():
        (_refuse if require_files else notes.append)(
            f"MODEL={model} does not exist; point MODEL at a prepared checkpoint dir or unset it")

    # ---- refusals that do not need the pool ----
    key, key_source = _api_key(env, probe.repo)
    host, exposed = s["HOST"], s["PUBLISHED_ON"]
    if not knobs.is_loopback(exposed) and not key:
        where = "PUBLISHED_ON" if "PUBLISHED_ON" in explicit else "HOST"
        _refuse(f"{where}={exposed} would serve the model to the network without authentication; set VLLM_API_KEY "
                f"(or write a key to {API_KEY_FILE}: openssl rand -hex 24 > {API_KEY_FILE}), or {where}=127.0.0.1")
    if exposed != host:
        notes.append(f"HOST={host} inside, reachable from {exposed} (PUBLISHED_ON): the API-key rule uses {exposed}")
    extra = shlex.split(s["EXTRA_ARGS"])
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        _refuse("EXTRA_ARGS carries --api-key, which every user of this machine can read in the process list; "
                f"set VLLM_API_KEY or write it to {API_KEY_FILE} instead")
    if s["REQ_METRICS"] and "--disable-log-stats" in extra:
        _refuse("REQ_METRICS=1 needs vLLM's stats logging, and EXTRA_ARGS has --disable-log-stats; drop one")
    if s["INT8_ACT"] == "int8" and s["INT8_LAYERS"] == "mlp|linear_attn":
        _refuse("INT8_LAYERS=mlp|linear_attn crashes inductor at the first forward on this pin; use "
                "INT8_LAYERS=mlp or INT8_LAYERS='mlp|linear_attn|self_attn'")
    if s["INT8_ACT"] == "off" and "INT8_LAYERS" in explicit:
        warnings.append("INT8_LAYERS is set but INT8_ACT=off; set INT8_ACT=int8 for it to apply")
    if mode == "batch" and s["INT8_LAYERS"] == "." and "GPU_UTIL" in explicit and s["GPU_UTIL"] > 0.95:
        warnings.append(f"INT8_LAYERS=. needs GPU_UTIL<=0.95 (spec), GPU_UTIL={s['GPU_UTIL']} may not boot")
    parsers = probe.tool_parsers
    if s["TOOLS"] and parsers and s["TOOL_PARSER"] not in parsers:
        close = difflib.get_close_matches(s["TOOL_PARSER"], sorted(parsers), n=1)
        _refuse(f"TOOL_PARSER={s['TOOL_PARSER']} is not a vLLM tool parser"
                + (f"; did you mean {close[0]}?" if close else "; leave it at qwen3_coder"))
    if s["TOOLS"] and s["TOOL_PARSER"] == "hermes":
        warnings.append("TOOL_PARSER=hermes reads JSON calls; this model's template emits XML (qwen3_coder)")

    if spec == "dflash2":
        if s["DFLASH_TOKENS"] > 7 and s["MAX_SEQS"] > 4:
            _refuse(f"DFLASH_TOKENS={s['DFLASH_TOKENS']} with MAX_SEQS={s['MAX_SEQS']}: a long verify block "
                    "doubles every resident's state page and this boots, then dies on the first concurrent "
                    "batch (spec); set MAX_SEQS=4 (or unset it) or DFLASH_TOKENS=7")
        if s["ASYNC_SCHED"]:
            _refuse("ASYNC_SCHED=1 with SPEC=dflash2: the verify-block length reaches the scheduler only "
                    "on the synchronous path; unset ASYNC_SCHED")
        drafter = Path(s["DRAFT"]) if Path(s["DRAFT"]).is_absolute() else probe.repo / s["DRAFT"]
        if not (drafter / "config.json").is_file():
            msg = (f"SPEC=dflash2 needs the drafter in {s['DRAFT']}: run {VENV_PYTHON} prepare/fetch_dflash2.py, "
                   "or set DRAFT=<drafter dir>, or SPEC=mtp")
            if require_files:
                _refuse(msg)
            if "DRAFT" in explicit:
                notes.append(msg)
        if "DRAFT_TOKENS" in explicit:
            warnings.append("DRAFT_TOKENS is MTP's depth; with SPEC=dflash2 set DFLASH_TOKENS")
        if s["VISION"] and not s["VISION_OFFLOAD"]:
            warnings.append("SPEC=dflash2 VISION=1 VISION_OFFLOAD=0 does not boot on a 24 GB card (spec)")
    if spec == "mtp" and ctx == "long" and s["DRAFT_TOKENS"] > 3:
        _refuse(f"DRAFT_TOKENS={s['DRAFT_TOKENS']} on CTX=long: FlashInfer's spec-decode path dies with an "
                "illegal memory access with 4 drafts once requests finish mid-batch (spec); set DRAFT_TOKENS=3 "
                "(or 2), or CTX=fast for 4 drafts")
    if spec == "mtp" and ctx == "huge" and s["CUDAGRAPH_MODE"] not in ("PIECEWISE", "NONE"):
        warnings.append(f"CUDAGRAPH_MODE={s['CUDAGRAPH_MODE']} with SPEC=mtp CTX=huge is unsafe: under FULL "
                        "capture one prompt length in 128 comes back corrupted on a prefix-cache hit (spec)")

    # ---- KV dtype and attention backend ----
    kv_dtype, backend, kv_why = _kv_choice(mode, s)
    derived.append(Derived("kv-cache-dtype", kv_dtype, kv_why))
    if backend:
        derived.append(Derived("attention-backend", backend, kv_why))
    if kv_dtype == HUGE_KV and probe.kv_dtypes and HUGE_KV not in probe.kv_dtypes:
        what = "CTX=huge" if mode == "single" else "KV=kvarn"
        other = "CTX=long (150k)" if mode == "single" else "KV=int4pth (vLLM's own int4 cache) or KV=fp8"
        _refuse(f"{what} needs the KVarN long-context KV cache, which this vLLM does not have; run "
                f"bash kvarn/install.sh, or set {other}")

    # ---- pool ----
    spec_tokens = {"mtp": s.get("DRAFT_TOKENS", 0), "dflash2": s.get("DFLASH_TOKENS", 0)}.get(spec, 0)
    cache = None
    if kv_dtype != HUGE_KV:
        cache = memory.CacheShape(kv_dtype=kv_dtype, state_dtype=s["STATE_DTYPE"], spec=spec, spec_tokens=spec_tokens,
                                  prefix_cache=bool(s["PREFIX_CACHE"]), async_scheduling=bool(s["ASYNC_SCHED"]),
                                  max_num_batched_tokens=memory.PREFILL_CHUNK if mode == "single" else 8192)
    weights = memory.weights_bytes(spec, fast_variant=(model == FAST_MODEL), vision=bool(s["VISION"]))
    kv_mem: int | None = s["KV_MEM"] if isinstance(s["KV_MEM"], int) else None
    if s["KV_MEM"] == "auto":
        if probe.free_vram is None:
            _refuse(f"KV_MEM=auto needs the free VRAM and {probe.vram_source}; set KV_MEM to bytes "
                    "(5583457484 = 5.2 GiB) or leave it empty to size the pool from GPU_UTIL")
        kv_mem = memory.auto_kv_mem(probe.free_vram, weights)
        notes.append(f"KV_MEM=auto -> {kv_mem} bytes ({kv_mem / memory.GiB:.2f} GiB): {_gib(probe.free_vram)} free "
                     f"- {_gib(weights)} weights - {_gib(memory.CUDAGRAPH_BYTES)} graphs - "
                     f"{_gib(memory.ACTIVATION_PEAK_BYTES)} activation peak - {_gib(memory.AUTO_MARGIN_BYTES)} margin")
    max_len = s["MAX_LEN"]
    len_explicit = "MAX_LEN" in explicit or (spec == "dflash2" and "DFLASH_MAX_LEN" in explicit)
    if cache and s["KV_MEM"] == "auto" and not len_explicit and not cache.fits(kv_mem, max_len):
        fitted = cache.longest_context(kv_mem)
        if fitted >= 4096:
            notes.append(f"MAX_LEN={fitted} (from {max_len}) because that is the longest context the "
                         f"KV_MEM=auto pool holds; free VRAM or set MAX_LEN and KV_MEM by hand")
            max_len = fitted
            derived.append(Derived("max-model-len", fitted, "KV_MEM=auto: the longest context the pool holds"))
    if cache and kv_mem is not None and not cache.fits(kv_mem, max_len):
        _refuse(f"MAX_LEN={max_len} does not fit one request in a {kv_mem / memory.GiB:.2f} GiB pool "
                f"(longest that fits: {cache.longest_context(kv_mem)}); lower MAX_LEN or raise KV_MEM")
    if cache and kv_mem is not None and s["MAX_SEQS"] > cache.num_blocks(kv_mem):
        # vLLM 0.28.0 stops at CUDA-graph capture: every decode sequence needs a GDN state block (H200, 2026-11-29)
        _refuse(f"MAX_SEQS={s['MAX_SEQS']} is more than the {cache.num_blocks(kv_mem)} blocks of a "
                f"{kv_mem / memory.GiB:.2f} GiB pool (vLLM needs one GDN state block per sequence); lower MAX_SEQS "
                "or raise KV_MEM")
    if kv_mem is None and s["KV_MEM"] == "":
        derived.append(Derived("pool", f"--gpu-memory-utilization {s['GPU_UTIL']}", "KV_MEM empty: vLLM sizes it"))

    # ---- argv ----
    argv = ["vllm", "serve", model, "--served-model-name", SERVED_NAME, "--host", host, "--port", str(s["PORT"]),
            "--max-num-seqs", str(s["MAX_SEQS"]), "--max-model-len", str(max_len),
            "--mamba-ssm-cache-dtype", s["STATE_DTYPE"]]
    if kv_dtype != "auto":
        argv += ["--kv-cache-dtype", kv_dtype]
    if backend:
        argv += ["--attention-backend", backend]
    argv += ["--kv-cache-memory-bytes", str(kv_mem)] if kv_mem is not None else \
        ["--gpu-memory-utilization", str(s["GPU_UTIL"])]
    if s["PREFIX_CACHE"]:
        argv += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        argv += ["--no-enable-prefix-caching"]  # vLLM 0.28.0 turns it on for hybrids unless told not to
    if spec == "mtp":
        argv += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": spec_tokens,
                                                     "draft_sample_method": s["DRAFT_SAMPLE"]})]
    elif spec == "dflash2":
        argv += ["--speculative-config", json.dumps({"method": "dflash", "model": s["DRAFT"],
                                                     "num_speculative_tokens": spec_tokens})]
    argv += ["--async-scheduling"] if s["ASYNC_SCHED"] else ["--no-async-scheduling"]
    if s["CUDAGRAPH_MODE"] != "auto":
        argv += ["--compilation-config", json.dumps({"cudagraph_mode": s["CUDAGRAPH_MODE"]})]
    if mode == "single":
        argv += ["--max-num-batched-tokens", str(memory.PREFILL_CHUNK)]
    if s["TOOLS"]:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", s["TOOL_PARSER"]]
    if s["VISION"]:
        argv += ["--limit-mm-per-prompt", json.dumps({"image": 1}),
                 "--mm-processor-kwargs", json.dumps({"max_pixels": VISION_MAX_PIXELS})]
    else:
        argv += ["--language-model-only"]
    if s["REQ_METRICS"]:
        argv += ["--enable-per-request-metrics", "--enable-force-include-usage"]
    if s["API_SERVERS"] != 1:
        argv += ["--api-server-count", str(s["API_SERVERS"])]
    if s["GDN_PREFILL"] != "auto":
        argv += ["--gdn-prefill-backend", s["GDN_PREFILL"]]
    argv += extra

    # ---- exported variables ----
    out_env: dict[str, str] = {}
    if s["INT8_ACT"] == "int8":
        out_env["VLLM_MARLIN_INPUT_DTYPE"] = "int8"
        out_env["VLLM_MARLIN_INT8_INCLUDE_RE"] = s["INT8_LAYERS"]
    if spec in ("mtp", "dflash2") and s["SPEC_ATTN"]:
        out_env["VLLM_SPEC_DECODE_ATTN"] = "1"
    if spec == "mtp":
        out_env["VLLM_MTP_DRAFT_VOCAB"] = str(s["MTP_DRAFT_VOCAB"])
    if spec == "dflash2":
        out_env["VLLM_DFLASH2_LOOKUP"] = str(s["LOOKUP"])
        if s["LOOKUP"]:
            for name, _, _ in knobs.LOOKUP_SUBKNOBS:
                out_env[f"VLLM_DFLASH2_LOOKUP_{name}"] = str(s[f"VLLM_DFLASH2_LOOKUP_{name}"])
        if probe.wsl2 and env.get("VLLM_WSL2_ENABLE_PIN_MEMORY") != "1":
            out_env["VLLM_WSL2_ENABLE_PIN_MEMORY"] = "1"
            notes.append("VLLM_WSL2_ENABLE_PIN_MEMORY=1 because this is WSL2 and SPEC=dflash2 (the V2 runner "
                         "allocates UVA buffers, which need pinned memory)")
        if s["LOOKUP"] and s["VLLM_DFLASH2_LOOKUP_NMIN"] > s["VLLM_DFLASH2_LOOKUP_NMAX"]:
            _refuse("VLLM_DFLASH2_LOOKUP_NMIN is above VLLM_DFLASH2_LOOKUP_NMAX; the lookup could never match")
    if mode == "single" and s["PREFILL_ATTN"] == "int8":
        out_env["VLLM_PREFILL_INT8_ATTN"] = "1"
        if s["INT8_ACT"] != "int8":
            warnings.append("PREFILL_ATTN=int8 alone is noise-to-slightly-positive (spec); pair it with INT8_ACT=int8")
    if s["VISION"] and s["VISION_OFFLOAD"]:
        out_env["VLLM_VISION_CPU_OFFLOAD"] = "1"
    secret = {"VLLM_API_KEY": key} if key_source == API_KEY_FILE else {}

    # ---- what the pool holds ----
    if cache:
        derived.append(Derived("block size", f"{cache.block_size} tokens",
                               "smallest multiple of 16 whose page holds one GDN state (vLLM hybrid alignment)"))
        derived.append(Derived("KV groups", cache.groups, f"{cache.group_size} layers per group"))
        derived.append(Derived("state page per resident", _gib(cache.resident_bytes()),
                               f"(1+k) GDN state pages, k={spec_tokens}"
                               + (", +1 for prefix caching" if s["PREFIX_CACHE"] else "")
                               + (", + the drafter's window" if spec == "dflash2" else "")))
        if kv_mem is not None:
            derived += _pool_lines(cache, kv_mem, max_len, s["MAX_SEQS"])
    derived.append(Derived("weights on GPU", _gib(weights), "memory model (int4 body, int8 embed, prepared heads)"))
    return ServePlan(mode, settings, tuple(argv), out_env, secret, key_source, tuple(notes), tuple(warnings),
                     tuple(derived), tuple(missing), cache, kv_mem)


def _refuse(message: str) -> None:
    raise PlanError(message)


def _gib(n: float) -> str:
    return f"{n / memory.GiB:.2f} GiB"


def _kv_choice(mode: str, s: Mapping[str, object]) -> tuple[str, str, str]:
    if mode == "batch":
        return {"fp8": ("fp8", "", "KV=fp8"),
                "int4pth": ("int4_per_token_head", "TRITON_ATTN", "KV=int4pth: vLLM's per-token-head int4"),
                "kvarn": (HUGE_KV, "", "KV=kvarn")}[s["KV"]]
    ctx, spec = s["CTX"], s["SPEC"]
    if ctx == "huge":
        return HUGE_KV, "", "CTX=huge: KVarN 4/2-bit"
    if ctx == "long" and spec == "dflash2":
        return "int8_per_token_head", "TRITON_ATTN", "CTX=long with SPEC=dflash2: int8 per-token-head on Triton"
    if ctx == "long":
        return "fp8", "FLASHINFER", "CTX=long: fp8 KV, which needs FlashInfer on Ampere"
    return "auto", "FLASH_ATTN", "CTX=fast: bf16 KV on FlashAttention (the split-KV verify patch hooks it)"


def _pool_lines(cache: memory.CacheShape, kv_mem: int, max_len: int, seats: int) -> list[Derived]:
    out = [Derived("pool", f"{cache.pool_tokens(kv_mem, max_len):,} tokens at {max_len:,} max-model-len",
                   f"{kv_mem / memory.GiB:.2f} GiB / {cache.bytes_per_token(kv_mem, max_len) / 1024:.1f} KiB per "
                   "token (vLLM 0.28.0's capacity arithmetic)"),
           Derived("longest context", f"{cache.longest_context(kv_mem):,} tokens", "one request alone in the pool")]
    for prompt in (128, 4096, 16384):
        n = cache.residents(kv_mem, prompt)
        out.append(Derived(f"resident at {prompt:,}-token prompts", f"{min(n, seats)} of MAX_SEQS={seats}"
                           + ("" if n >= seats else f" (the pool holds {n}; the rest queue)"), "memory model"))
    return out


def explain_lines(plan: ServePlan, probe: Probe) -> list[str]:
    lines = [f"# {plan.mode} plan: every knob, then every derived value, with the rule that set it"]
    for name, setting in plan.settings.items():
        if setting.source == "env":
            why = "set in the environment"
        elif setting.rule and setting.rule.describe():
            why = f"default because {setting.rule.describe()}" + (f" ({setting.rule.why})" if setting.rule.why else "")
        else:
            why = "default"
        lines.append(f"{name:32} = {setting.value!s:24} {why}")
    lines.append("# derived")
    for d in plan.derived:
        lines.append(f"{d.name:32} = {d.value!s:24} {d.why}")
    lines.append("# this card")
    if probe.free_vram is None:
        lines.append(f"{'free VRAM':32} = {'unknown':24} {probe.vram_source}")
    else:
        lines.append(f"{'free VRAM':32} = {_gib(probe.free_vram):24} of {_gib(probe.total_vram or 0)} "
                     f"({probe.vram_source}; what the desktop or WSL2 holds is already taken out)")
        if plan.cache:
            spec = plan.value("SPEC") if "SPEC" in plan.settings else "off"
            weights = memory.weights_bytes(spec, fast_variant=FAST_MODEL in plan.argv[2], vision=bool(plan.value("VISION")))
            fit = memory.auto_kv_mem(probe.free_vram, weights)
            lines.append(f"{'KV_MEM=auto would pin':32} = {_gib(fit):24} free - weights - graphs - activation "
                         f"peak - {_gib(memory.AUTO_MARGIN_BYTES)} margin")
            if fit > 0:
                lines += [f"  {d.name:30} = {d.value!s:24} {d.why}"
                          for d in _pool_lines(plan.cache, fit, plan.value("MAX_LEN"), plan.value("MAX_SEQS"))]
    if plan.missing:
        lines.append("# first start would run")
        lines += [f"{step.command}    # {step.what}" for step in plan.missing]
    return lines


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen_serving.plan", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=knobs.MODES)
    ap.add_argument("action", nargs="?", choices=("explain", "run"), help="explain, or run (exec vllm)")
    ap.add_argument("--dry-run", action="store_true", help="print the exports and the vllm command")
    ap.add_argument("--missing", action="store_true", help="print the first-start steps still to run")
    args = ap.parse_args(argv)
    env = dotenv.environment_or_exit(REPO / ".env") if env is None else env  # the environment over .env, as in Compose
    explain = args.action == "explain"
    try:
        probe = Probe.detect(read_gpu=explain or env.get("KV_MEM") == "auto")
        plan = build(args.mode, env, probe, require_files=args.action == "run")
    except PlanError as e:
        print(f"qwen-serving: refusing to start: {e}", file=sys.stderr)
        return 2
    if args.missing:
        print("\n".join(step.command for step in plan.missing))
        return 0
    for line in plan.notes:
        print(f"note: {line}", file=sys.stderr)
    for line in plan.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if explain:
        print("\n".join(explain_lines(plan, probe)))
        return 0
    if args.dry_run or args.action is None:
        for step in plan.missing:
            print(f"note: first start would run: {step.command}  ({step.what})", file=sys.stderr)
        print("\n".join([*plan.export_lines(), plan.command_line()]))
        return 0
    print(f"qwen-serving: {plan.command_line()}", file=sys.stderr)
    run_env = {**env, **plan.env, **plan.secret_env}
    # the repo venv's entry point whatever PATH says, then the one beside this python, then PATH
    found = [p for p in (probe.repo / "venv" / "bin" / "vllm", Path(sys.executable).parent / "vllm") if p.exists()]
    executable = str(found[0]) if found else shutil.which(plan.argv[0], path=run_env.get("PATH"))
    if not executable:
        print("qwen-serving: no vllm executable; run bash install.sh", file=sys.stderr)
        return 2
    os.execve(executable, list(plan.argv), run_env)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
