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

from . import knobs, memory
from .checkpoint import step_names
from .knobs import API_KEY_FILE, BASE_MODEL, FAST_MODEL, HUGE_KV, KNOBS, KnobError, Setting, Sized, Values

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = "venv/bin/python"
# VLLM_* names our patches read beside the knobs' own (for the misspelling check;
# tests/test_knob_effects.py checks that a patch reads each).
PATCH_ENV = ("VLLM_V2_CUDAGRAPH_MEM_MIB", "VLLM_SMALL_TOPK_SAMPLER")
WSL2_PIN_MEMORY = "VLLM_WSL2_ENABLE_PIN_MEMORY"  # exported by the plan itself on WSL2 for SPEC=dflash2
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


# Run by the serving venv's python in a child process: this module stays standard library only.
_TORCH_VRAM = ("import torch; assert torch.cuda.is_available(); "
               "print(*torch.cuda.mem_get_info(0))")


def read_vram() -> tuple[int | None, int | None, str]:
    """Free and total bytes of GPU 0: torch if it sees CUDA, else nvidia-smi, else (None, None, why)."""
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_VRAM], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        free, total = (int(x) for x in out.split())
        return free, total, "torch.cuda.mem_get_info"
    except (OSError, subprocess.SubprocessError, ValueError):  # no torch, or no CUDA: ask nvidia-smi
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
    ours = {k.name for k in KNOBS} | knobs.exported_vars()
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


def _first_start_steps(v: Values, model: str, probe: Probe) -> list[Step]:
    repo, py = probe.repo, VENV_PYTHON
    steps = []
    if not probe.vllm_installed:
        steps.append(Step("install the pinned, patched vLLM into venv/", "bash install.sh"))
    base = repo / BASE_MODEL
    if model in (BASE_MODEL, FAST_MODEL):
        done = _manifest_steps(base)
        if not (base / "config.json").is_file():
            steps.append(Step("download the W4A16 checkpoint (~19.5 GB, resumable)", f"{py} prepare/download.py"))
        for name, what in ((step_names.QUANT_LM_HEAD, "lm_head to int8"), (step_names.QUANT_EMBED, "embed_tokens to int8"),
                           (step_names.QUANT_MTP, "the MTP module to int8")):
            if name not in done:
                steps.append(Step(f"requantize {what} (CPU, minutes)", f"{py} prepare/{name}.py {BASE_MODEL}"))
        if v.mode == "single" and step_names.DRAFT_VOCAB not in done:
            steps.append(Step("build the 40k-token MTP draft head",
                              f"{py} prepare/build_draft_vocab.py {BASE_MODEL} --ids prepare/draft_vocab_ids.json"))
        if v.mode == "single" and not (repo / FAST_MODEL / "config.json").is_file():
            steps.append(Step("fetch the fast variant (~1 GB: int4 lm_head + MTP)", f"{py} prepare/fetch_fast_variant.py"))
    if v.spec == "dflash2" and v.draft == knobs.DFLASH2_DRAFTER:
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
    """Resolve the knobs, check them, size the pool, render the argv and the exports. Raises PlanError on a refusal."""
    probe = probe or Probe.detect()
    try:
        settings = knobs.resolve(mode, env)
    except KnobError as e:
        raise PlanError(str(e)) from None
    v = Values.of(mode, settings)
    notes, warnings, derived = _default_notes(settings), misspelt(env, mode, probe), []
    model = _model_dir(v, probe, require_files, notes, derived)
    missing = _first_start_steps(v, model, probe)
    key, key_source = _api_key(env, probe.repo)
    warnings += _check(v, probe, key, require_files, notes)
    sized, cache, weights = _size_pool(v, model, probe, notes, derived)
    argv, out_env = knobs.render(v, sized)
    if v.spec == "dflash2" and probe.wsl2 and env.get(WSL2_PIN_MEMORY) != "1":
        out_env[WSL2_PIN_MEMORY] = "1"
        notes.append(f"{WSL2_PIN_MEMORY}=1 because this is WSL2 and SPEC=dflash2 (the V2 runner "
                     "allocates UVA buffers, which need pinned memory)")
    secret = {knobs.SECRET_ENV: key} if key_source == API_KEY_FILE else {}
    if cache:
        derived += _cache_lines(cache, v, sized)
    derived.append(Derived("weights on GPU", _gib(weights), "memory model (int4 body, int8 embed, prepared heads)"))
    return ServePlan(mode, settings, tuple(argv), out_env, secret, key_source, tuple(notes), tuple(warnings),
                     tuple(derived), tuple(missing), cache, sized.kv_mem)


def _default_notes(settings: Mapping[str, Setting]) -> list[str]:
    """One note per default that a condition picked (every automatic adjustment is printed)."""
    notes = []
    for name, setting in settings.items():
        if setting.source == "default" and setting.rule is not None and setting.rule.describe():
            why = f": {setting.rule.why}" if setting.rule.why else ""
            notes.append(f"{name}={setting.value} because {setting.rule.describe()}{why}")
    return notes


def _model_dir(v: Values, probe: Probe, require_files: bool, notes: list[str], derived: list[Derived]) -> str:
    model = v.model
    if model == "auto":
        model = FAST_MODEL if (probe.repo / FAST_MODEL / "config.json").is_file() else BASE_MODEL
        if model == BASE_MODEL:
            notes.append(f"MODEL={BASE_MODEL}: the fast variant is not there yet (prepare/fetch_fast_variant.py)")
        derived.append(Derived("MODEL", model, "single: the fast variant if present, else the base requantization"))
    if "MODEL" in v.explicit and not (probe.repo / model).exists() and not Path(model).exists():
        (_refuse if require_files else notes.append)(
            f"MODEL={model} does not exist; point MODEL at a prepared checkpoint dir or unset it")
    return model


def _check(v: Values, probe: Probe, key: str, require_files: bool, notes: list[str]) -> list[str]:
    """Refuse what must not boot (PlanError); return the warnings. The knob rules are knobs.checks();
    here are the ones that need this machine: the API key, vLLM's tool parsers, the drafter's files."""
    if not knobs.is_loopback(v.published_on) and not key:
        where = "PUBLISHED_ON" if "PUBLISHED_ON" in v.explicit else "HOST"
        _refuse(f"{where}={v.published_on} would serve the model to the network without authentication; set "
                f"VLLM_API_KEY (or write a key to {API_KEY_FILE}: openssl rand -hex 24 > {API_KEY_FILE}), or "
                f"{where}=127.0.0.1")
    if v.published_on != v.host:
        notes.append(f"HOST={v.host} inside, reachable from {v.published_on} (PUBLISHED_ON): the API-key rule uses "
                     f"{v.published_on}")
    refusals, warnings = knobs.violations(v)
    if refusals:
        _refuse(refusals[0])
    parsers = probe.tool_parsers
    if v.tools and parsers and v.tool_parser not in parsers:
        close = difflib.get_close_matches(v.tool_parser, sorted(parsers), n=1)
        _refuse(f"TOOL_PARSER={v.tool_parser} is not a vLLM tool parser"
                + (f"; did you mean {close[0]}?" if close else "; leave it at qwen3_coder"))
    if v.spec == "dflash2":
        drafter = Path(v.draft) if Path(v.draft).is_absolute() else probe.repo / v.draft
        if not (drafter / "config.json").is_file():
            msg = (f"SPEC=dflash2 needs the drafter in {v.draft}: run {VENV_PYTHON} prepare/fetch_dflash2.py, "
                   "or set DRAFT=<drafter dir>, or SPEC=mtp")
            if require_files:
                _refuse(msg)
            if "DRAFT" in v.explicit:
                notes.append(msg)
    return warnings


def _size_pool(v: Values, model: str, probe: Probe, notes: list[str],
               derived: list[Derived]) -> tuple[Sized, memory.CacheShape | None, int]:
    """The KV layout, the pool in bytes (KV_MEM, or from free VRAM for `auto`) and the context it holds."""
    kv_dtype, backend, kv_why = knobs.kv_layout(v)
    derived.append(Derived("kv-cache-dtype", kv_dtype, kv_why))
    if backend:
        derived.append(Derived("attention-backend", backend, kv_why))
    if kv_dtype == HUGE_KV and probe.kv_dtypes and HUGE_KV not in probe.kv_dtypes:
        what = "CTX=huge" if v.mode == "single" else "KV=kvarn"
        other = "CTX=long (150k)" if v.mode == "single" else "KV=int4pth (vLLM's own int4 cache) or KV=fp8"
        _refuse(f"{what} needs the KVarN long-context KV cache, which this vLLM does not have (the KVarN cache is "
                f"not built yet); set {other}")
    batched_tokens = memory.PREFILL_CHUNK if v.mode == "single" else None
    cache = None
    if kv_dtype != HUGE_KV:
        cache = memory.CacheShape(kv_dtype=kv_dtype, state_dtype=v.state_dtype, spec=v.spec,
                                  spec_tokens=_spec_tokens(v), prefix_cache=bool(v.prefix_cache),
                                  async_scheduling=bool(v.async_sched), max_num_batched_tokens=batched_tokens or 8192)
    weights = memory.weights_bytes(v.spec, fast_variant=(model == FAST_MODEL), vision=bool(v.vision))
    kv_mem = v.kv_mem if isinstance(v.kv_mem, int) else None
    if v.kv_mem == "auto":
        if probe.free_vram is None:
            _refuse(f"KV_MEM=auto needs the free VRAM and {probe.vram_source}; set KV_MEM to bytes "
                    "(5583457484 = 5.2 GiB) or leave it empty to size the pool from GPU_UTIL")
        kv_mem = memory.auto_kv_mem(probe.free_vram, weights)
        notes.append(f"KV_MEM=auto -> {kv_mem} bytes ({kv_mem / memory.GiB:.2f} GiB): {_gib(probe.free_vram)} free "
                     f"- {_gib(weights)} weights - {_gib(memory.CUDAGRAPH_BYTES)} graphs - "
                     f"{_gib(memory.ACTIVATION_PEAK_BYTES)} activation peak - {_gib(memory.AUTO_MARGIN_BYTES)} margin")
    max_len = v.max_len
    len_explicit = "MAX_LEN" in v.explicit or (v.spec == "dflash2" and "DFLASH_MAX_LEN" in v.explicit)
    if cache and v.kv_mem == "auto" and not len_explicit and not cache.fits(kv_mem, max_len):
        fitted = cache.longest_context(kv_mem)
        if fitted >= 4096:
            notes.append(f"MAX_LEN={fitted} (from {max_len}) because that is the longest context the "
                         f"KV_MEM=auto pool holds; free VRAM or set MAX_LEN and KV_MEM by hand")
            max_len = fitted
            derived.append(Derived("max-model-len", fitted, "KV_MEM=auto: the longest context the pool holds"))
    if cache and kv_mem is not None and not cache.fits(kv_mem, max_len):
        _refuse(f"MAX_LEN={max_len} does not fit one request in a {kv_mem / memory.GiB:.2f} GiB pool "
                f"(longest that fits: {cache.longest_context(kv_mem)}); lower MAX_LEN or raise KV_MEM")
    if cache and kv_mem is not None and v.max_seqs > cache.num_blocks(kv_mem):
        # vLLM 0.28.0 stops at CUDA-graph capture: every decode sequence needs a GDN state block (H200, 2026-11-29)
        _refuse(f"MAX_SEQS={v.max_seqs} is more than the {cache.num_blocks(kv_mem)} blocks of a "
                f"{kv_mem / memory.GiB:.2f} GiB pool (vLLM needs one GDN state block per sequence); lower MAX_SEQS "
                "or raise KV_MEM")
    if kv_mem is None and v.kv_mem == "":
        derived.append(Derived("pool", f"--gpu-memory-utilization {v.gpu_util}", "KV_MEM empty: vLLM sizes it"))
    return Sized(model, max_len, kv_mem, kv_dtype, backend, batched_tokens), cache, weights


def _spec_tokens(v: Values) -> int:
    return {"mtp": v.draft_tokens, "dflash2": v.dflash_tokens}.get(v.spec, 0)


def _cache_lines(cache: memory.CacheShape, v: Values, sized: Sized) -> list[Derived]:
    """What the pool holds: block size, groups, the state page per resident, and the pool itself."""
    lines = [Derived("block size", f"{cache.block_size} tokens",
                     "smallest multiple of 16 whose page holds one GDN state (vLLM hybrid alignment)"),
             Derived("KV groups", cache.groups, f"{cache.group_size} layers per group"),
             Derived("state page per resident", _gib(cache.resident_bytes()),
                     f"(1+k) GDN state pages, k={_spec_tokens(v)}"
                     + (", +1 for prefix caching" if v.prefix_cache else "")
                     + (", + the drafter's window" if v.spec == "dflash2" else ""))]
    if sized.kv_mem is not None:
        lines += _pool_lines(cache, sized.kv_mem, sized.max_len, v.max_seqs)
    return lines


def _refuse(message: str) -> None:
    raise PlanError(message)


def _gib(n: float) -> str:
    return f"{n / memory.GiB:.2f} GiB"


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
    env = os.environ if env is None else env
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
