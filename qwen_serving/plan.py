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
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import dotenv, knobs, memory, vllm_028
from . import model as model_dims
from .checkpoint import step_names
from .engine import env_vars
from .knobs import API_KEY_FILE, BASE_MODEL, FAST_MODEL, KNOBS, KnobError, Setting, Sized, Values

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = "venv/bin/python"
WSL2_PIN_MEMORY = "VLLM_WSL2_ENABLE_PIN_MEMORY"  # exported by the plan itself on WSL2 for SPEC=dflash2
CALIBRATE = "bash single-user/calibrate.sh"  # builds the MTP draft head from the running server's outputs


class PlanError(ValueError):
    """A configuration that must not boot; the message says what to set instead."""


@dataclass(frozen=True)
class Probe:
    """Facts about this machine that the plan depends on. What vLLM accepts comes from vllm_028 (what the plan
    knows of 0.28.0), never from the installed package: the plan answers the same before install and after."""

    repo: Path = REPO
    kv_dtypes: frozenset[str] = vllm_028.KV_CACHE_DTYPES
    vllm_env: frozenset[str] = vllm_028.ENV_NAMES
    tool_parsers: frozenset[str] = vllm_028.TOOL_PARSERS
    free_vram: int | None = None  # the card that decides: the least free of those visible
    total_vram: int | None = None
    vram_source: str = "not read"
    wsl2: bool = False
    vllm_installed: bool = True  # the serving venv has a vllm entry point
    cards: tuple[tuple[int, int], ...] = ()  # (free, total) bytes of every visible card, when read

    @classmethod
    def detect(cls, repo: Path = REPO, read_gpu: bool = False) -> Probe:
        free = total = None
        cards: tuple[tuple[int, int], ...] = ()
        source = "not read (explain and KV_MEM=auto read it)"
        if read_gpu:
            cards, source = read_cards()
            if cards:
                free, total = min(cards)
        try:
            wsl2 = "microsoft" in Path("/proc/version").read_text().lower()
        except OSError:
            wsl2 = False
        installed = (repo / "venv" / "bin" / "vllm").exists() or shutil.which("vllm") is not None
        return cls(repo, free_vram=free, total_vram=total, vram_source=source, wsl2=wsl2, vllm_installed=installed,
                   cards=cards)

    def gpus(self) -> tuple[tuple[int, int], ...]:
        """(free, total) of every card read; a probe given only free_vram is one card."""
        if self.cards:
            return self.cards
        return () if self.free_vram is None else ((self.free_vram, self.total_vram or 0),)


# Run by the serving venv's python in a child process: this module stays standard library only.
_TORCH_VRAM = ("import torch; assert torch.cuda.is_available()\n"
               "for i in range(torch.cuda.device_count()): print(*torch.cuda.mem_get_info(i))")
SMI_QUERY = ["--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"]


def read_cards(env: Mapping[str, str] = os.environ) -> tuple[tuple[tuple[int, int], ...], str]:
    """(free, total) bytes of every visible card, and where they came from: torch if it sees CUDA, else nvidia-smi
    (limited to CUDA_VISIBLE_DEVICES when that is set), else () and why."""
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_VRAM], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        cards = _rows(out, 1)
        if cards:
            return cards, "torch.cuda.mem_get_info"
    except (OSError, subprocess.SubprocessError, ValueError):  # no torch, or no CUDA: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if not smi:
        return (), "cannot read free VRAM: no CUDA torch and no nvidia-smi"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return (), "CUDA_VISIBLE_DEVICES is empty: no card is visible"
    try:
        out = subprocess.run([smi, *SMI_QUERY, *(["-i", visible.replace(" ", "")] if visible else [])],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        cards = _rows(out, memory.MiB)
    except (OSError, subprocess.SubprocessError, ValueError):
        return (), "nvidia-smi failed"
    return (cards, "nvidia-smi") if cards else ((), "nvidia-smi lists no GPU")


def _rows(text: str, unit: int) -> tuple[tuple[int, int], ...]:
    """`free total` (or `free, total`) lines -> (free, total) bytes; raises ValueError on anything else."""
    rows = []
    for line in filter(None, (line.strip() for line in text.splitlines())):
        free, total = (int(x) * unit for x in line.replace(",", " ").split())
        rows.append((free, total))
    return tuple(rows)


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
    served: str = ""  # the checkpoint dir vLLM serves once the first-start steps have run (MODEL=auto: the fast one)

    def value(self, name: str) -> object:
        return self.settings[name].value

    def export_lines(self) -> list[str]:
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        if self.key_source == API_KEY_FILE:
            lines.append(f'export VLLM_API_KEY="$(head -n1 {API_KEY_FILE})"')
        return lines

    def command_line(self) -> str:
        return shlex.join(self.argv)


def api_key(env: Mapping[str, str], repo: Path) -> tuple[str, str]:
    """The server's key and where it came from: VLLM_API_KEY, else the first non-blank line of api_key.txt;
    ("", "") when there is none. The clients in bench/ find it the same way (bench.serving.api_key)."""
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
    known = ours | set(probe.vllm_env) | set(env_vars.BY_NAME) | {"VLLM_API_KEY"}  # BY_NAME: what patches read
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


def _first_start_steps(v: Values, model: str, probe: Probe, draft_head: Step | None) -> list[Step]:
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
        if v.mode == "single" and not (repo / FAST_MODEL / "config.json").is_file():
            steps.append(Step("fetch the fast variant (~1 GB: int4 lm_head + MTP)", f"{py} prepare/fetch_fast_variant.py"))
    if draft_head:  # after the fast variant: it replaces the lm_head the draft head's rows come from
        steps.append(draft_head)
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


def build(mode: str, env: Mapping[str, str], probe: Probe | None = None, require_files: bool = False,
          will_create: Collection[str] = ()) -> ServePlan:
    """Resolve the knobs, check them, size the pool, render the argv and the exports. Raises PlanError on a refusal.
    will_create: paths the caller makes before the server starts (bench/gpu/run_full.py generates its checkpoint),
    which may be absent like the first start's own."""
    probe = probe or Probe.detect()
    try:
        settings = knobs.resolve(mode, env)
    except KnobError as e:
        raise PlanError(str(e)) from None
    v = Values.of(mode, settings)
    notes, warnings, derived = _default_notes(settings), misspelt(env, mode, probe), []
    _check_tp(v)
    _check_paths(v, probe, will_create)
    model = _model_dir(v, probe, notes, derived)
    served = FAST_MODEL if v.mode == "single" and v.model == "auto" else model  # first start fetches the fast one
    draft_head, settings = _draft_head(v, served, probe, settings, notes, derived)
    v = Values.of(mode, settings)
    missing = _first_start_steps(v, model, probe, draft_head)
    key, key_source = api_key(env, probe.repo)
    warnings += _check(v, probe, key, require_files, notes)
    _check_vision(v, _in_repo(probe, served))
    sized, cache, weights = _size_pool(v, model, probe, notes, derived)
    argv, out_env = knobs.render(v, sized)
    if v.spec == "dflash2" and probe.wsl2 and env.get(WSL2_PIN_MEMORY) != "1":
        out_env[WSL2_PIN_MEMORY] = "1"
        notes.append(f"{WSL2_PIN_MEMORY}=1 because this is WSL2 and SPEC=dflash2 (the V2 runner "
                     "allocates UVA buffers, which need pinned memory)")
    secret = {knobs.SECRET_ENV: key} if key_source == API_KEY_FILE else {}
    if cache:
        derived += _cache_lines(cache, v, sized)
    if v.tp == 1:
        derived.append(Derived("weights on GPU", _gib(weights), "memory model (int4 body, int8 embed, prepared heads)"))
    else:
        derived += _card_lines(v, model)
    return ServePlan(mode, settings, tuple(argv), out_env, secret, key_source, tuple(notes), tuple(warnings),
                     tuple(derived), tuple(missing), cache, sized.kv_mem, served)


def _check_tp(v: Values) -> None:
    """TP must split every head count and every Marlin tile of the model (and of the DFlash2 drafter) evenly."""
    splits = model_dims.TP_SPLITS + (model_dims.DRAFTER_TP_SPLITS if v.spec == "dflash2" else ())
    problems = model_dims.tp_problems(v.tp, splits)
    if problems:
        sizes = [n for n in model_dims.tp_sizes(splits) if n > 1]
        _refuse(f"TP={v.tp}: this model does not split across {v.tp} cards: {'; '.join(problems)}; set "
                f"{' or '.join(f'TP={n}' for n in sizes)} (or TP=1, one card)")


def _default_notes(settings: Mapping[str, Setting]) -> list[str]:
    """One note per default that a condition picked (every automatic adjustment is printed)."""
    notes = []
    for name, setting in settings.items():
        if setting.source == "default" and setting.rule is not None and setting.rule.describe():
            why = f": {setting.rule.why}" if setting.rule.why else ""
            notes.append(f"{name}={setting.value} because {setting.rule.describe()}{why}")
    return notes


def _model_dir(v: Values, probe: Probe, notes: list[str], derived: list[Derived]) -> str:
    model = v.model
    if model == "auto":
        model = FAST_MODEL if (probe.repo / FAST_MODEL / "config.json").is_file() else BASE_MODEL
        if model == BASE_MODEL:
            notes.append(f"MODEL={BASE_MODEL}: the fast variant is not there yet (prepare/fetch_fast_variant.py)")
        derived.append(Derived("MODEL", model, "single: the fast variant if present, else the base requantization"))
    return model


def _check_paths(v: Values, probe: Probe, will_create: Collection[str]) -> None:
    """A path set by hand that does not exist is refused at once, by a dry run too and before install.sh runs;
    only the default dirs that the first-start steps create may be absent."""
    first_start = {BASE_MODEL, FAST_MODEL, "auto"} if v.mode == "single" else {BASE_MODEL}
    for name, value, created, fix in (
        ("MODEL", v.model, first_start, "point MODEL at a prepared checkpoint dir or unset it"),
        ("DRAFT", v.draft, {knobs.DFLASH2_DRAFTER},
         f"point DRAFT at a DFlash2 drafter dir, or unset it (first start fetches {knobs.DFLASH2_DRAFTER})"),
        ("DRAFT_IDS", v.draft_ids, set(), "point DRAFT_IDS at a JSON list of token ids, or unset it"),
    ):
        absent_ok = value in created or value in will_create
        if name in v.explicit and not absent_ok and not _in_repo(probe, value).exists():
            _refuse(f"{name}={value} does not exist; {fix}")


def _in_repo(probe: Probe, path: str) -> Path:
    """A knob's path as vLLM and the prepare steps see it: relative to the checkout, where they run."""
    return probe.repo / path  # an absolute path stays itself


def _draft_head(v: Values, served: str, probe: Probe, settings: Mapping[str, Setting], notes: list[str],
                derived: list[Derived]) -> tuple[Step | None, Mapping[str, Setting]]:
    """Where SPEC=mtp's draft head comes from, in order: the one in the served checkpoint; one the first start
    builds from a list the user has (DRAFT_IDS); else the full lm_head (MTP_DRAFT_VOCAB=0) until calibrate.sh
    builds one. Returns the build step, if any, and the settings with MTP_DRAFT_VOCAB as the plan serves it."""
    if v.mode != "single" or v.spec != "mtp" or not v.mtp_draft_vocab:
        return None, settings
    ids = _in_repo(probe, v.draft_ids)
    in_model = _draft_head_rows(_in_repo(probe, served))
    rows = len(_id_list(ids)) if in_model is None and ids.is_file() else in_model
    if rows and not model_dims.head_splits(rows, v.tp):
        tile = model_dims.MARLIN_MIN_N * v.tp
        why = (f"TP={v.tp} gives the draft head's {rows:,} rows {model_dims.padded_vocab(rows) // v.tp:,} per card; Marlin "
               f"needs a multiple of {model_dims.MARLIN_MIN_N}, and vLLM {vllm_028.VERSION} has no other kernel for an "
               "int8 head with bf16 activations (an int4 one would fall to the unmeasured Triton W4A16 kernel)")
        fix = f"build the head from a multiple of {tile} ids ({CALIBRATE} --k {max(tile, rows // tile * tile)})"
        if "MTP_DRAFT_VOCAB" in v.explicit:
            _refuse(f"MTP_DRAFT_VOCAB=1: {why}; {fix}, or unset MTP_DRAFT_VOCAB to draft over the full lm_head")
        notes.append(f"MTP_DRAFT_VOCAB=0 because {why}: MTP drafts over the full lm_head; {fix}")
        derived.append(Derived("MTP draft head", "full lm_head", f"the {rows:,}-row head does not split across TP={v.tp}"))
        return None, {**settings, "MTP_DRAFT_VOCAB": Setting(0, "plan", knobs.Rule(0, why=why))}
    if in_model is not None:
        derived.append(Derived("MTP draft head", "in MODEL", f"{served}/config.json names its draft_vocab"))
        return None, settings
    if ids.is_file():
        whose = "DRAFT_IDS" if "DRAFT_IDS" in v.explicit else "the list in this checkout"
        notes.append(f"the MTP draft head is built on first start from {v.draft_ids} ({whose})")
        derived.append(Derived("MTP draft head", f"built from {v.draft_ids}", whose))
        return Step(f"build the MTP draft head from {v.draft_ids}",
                    f"{VENV_PYTHON} prepare/build_draft_vocab.py {shlex.quote(served)} --ids {shlex.quote(v.draft_ids)}"), \
            settings
    if "MTP_DRAFT_VOCAB" in v.explicit:
        _refuse(f"MTP_DRAFT_VOCAB=1 asks for the MTP draft head, and {served} has none and {v.draft_ids} does not "
                f"exist; unset MTP_DRAFT_VOCAB (the full lm_head serves until a head is built), start, then run "
                f"{CALIBRATE}; or set DRAFT_IDS=<a JSON list of token ids>")
    why = (f"no draft vocabulary yet (no draft head in {served}, no {v.draft_ids}): MTP drafts over the full "
           "lm_head (correct, slower drafts)")
    notes.append(f"MTP_DRAFT_VOCAB=0 because {why}; once the server is up, {CALIBRATE} counts its own outputs, "
                 "builds a calibrated head and tells you to restart")
    derived.append(Derived("MTP draft head", "full lm_head", f"no head, no list: {CALIBRATE} builds one"))
    return None, {**settings, "MTP_DRAFT_VOCAB": Setting(0, "plan", knobs.Rule(0, why=why))}


def _draft_head_rows(model_dir: Path) -> int | None:
    """The rows of the draft head the checkpoint names in config.json, which is what the engine loads (patches/
    qwen3_5-mtp-draft-vocab.patch; 0 when it does not say), or None: no head. prepared.json may still record one
    the fast variant dropped."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    entry = config.get("draft_vocab") or (config.get("text_config") or {}).get("draft_vocab")
    if not entry:
        return None
    size = entry.get("size") if isinstance(entry, dict) else None
    return size if isinstance(size, int) and size > 0 else 0


def _id_list(path: Path) -> list:
    """The ids of a draft-vocabulary file (a list, or {"ids": [...]}, as prepare/ writes it); [] if unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    ids = data.get("ids") if isinstance(data, dict) else data
    return ids if isinstance(ids, list) else []


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
    if v.tools and v.tool_parser not in parsers:
        close = difflib.get_close_matches(v.tool_parser, sorted(parsers), n=1)
        _refuse(f"TOOL_PARSER={v.tool_parser} is not a vLLM tool parser"
                + (f"; did you mean {close[0]}?" if close else "; leave it at qwen3_coder"))
    if v.spec == "dflash2" and require_files and not (_in_repo(probe, v.draft) / "config.json").is_file():
        _refuse(f"SPEC=dflash2 needs the drafter in {v.draft}: run {VENV_PYTHON} prepare/fetch_dflash2.py, "
                "or set DRAFT=<drafter dir>, or SPEC=mtp")
    return warnings


VLLM_BATCHED_TOKENS = 8192  # --max-num-batched-tokens where the mode leaves it to vLLM (batch)
VISUAL_PREFIX = "model.visual."  # the tower's tensors in the checkpoint (vLLM maps them to `visual.`)


def _check_vision(v: Values, model_dir: Path) -> None:
    """VISION=1 on a checkpoint the plan can read: vLLM needs the tower's weights (else its loader stops after
    minutes with "weights were not initialized") and the image processor's config (else no image parses)."""
    if not v.vision:
        return
    try:
        weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not there yet, or not readable: prepare_status and vLLM judge it
    if not any(name.startswith(VISUAL_PREFIX) for name in weight_map):
        _refuse(f"VISION=1 needs the vision tower, and {model_dir} has no {VISUAL_PREFIX}* tensors (a text-only "
                "checkpoint); serve one that has it (MODEL=...), or VISION=0")
    if not (model_dir / "preprocessor_config.json").is_file():
        _refuse(f"VISION=1 needs the image processor's preprocessor_config.json, and {model_dir} has none; copy it "
                "from the checkpoint's repository, or VISION=0")


def _size_pool(v: Values, model: str, probe: Probe, notes: list[str],
               derived: list[Derived]) -> tuple[Sized, memory.CacheShape | None, int]:
    """The KV layout, the pool in bytes (KV_MEM, or from free VRAM for `auto`) and the context it holds."""
    kv_dtype, backend, kv_why = knobs.kv_layout(v)
    derived.append(Derived("kv-cache-dtype", kv_dtype, kv_why))
    if backend:
        derived.append(Derived("attention-backend", backend, kv_why))
    if kv_dtype not in probe.kv_dtypes:  # a cache this plan asks for must be one the vLLM it serves takes
        _refuse(f"--kv-cache-dtype {kv_dtype} ({kv_why}) is not a cache type vLLM {vllm_028.VERSION} takes; set "
                f"{'CTX=fast' if v.mode == 'single' else 'KV=fp8'}")
    batched_tokens = memory.PREFILL_CHUNK if v.mode == "single" else None
    cache = memory.CacheShape(kv_dtype=kv_dtype, state_dtype=v.state_dtype, spec=v.spec,
                              spec_tokens=_spec_tokens(v), prefix_cache=bool(v.prefix_cache),
                              async_scheduling=bool(v.async_sched), max_num_batched_tokens=batched_tokens or VLLM_BATCHED_TOKENS,
                              tp=v.tp)
    offload_gib = _vision_offload_gib(lambda name: getattr(v, name.lower()))
    weights = memory.weights_bytes(v.spec, fast_variant=(model == FAST_MODEL), vision=bool(v.vision), tp=v.tp,
                                   vision_offload_gib=offload_gib)
    encoder_cache = _encoder_cache(v.mode, bool(v.vision))
    if v.vision:
        on_card = memory.vision_card_bytes(offload_gib)
        where = ("BF16 weights (in the weights below), whole on every card" if offload_gib is None else
                 f"{_gib(memory.VISION_TOWER_BYTES)} of BF16 weights in host RAM, each module copied to the "
                 f"card for its forward, at most {_gib(on_card)} there at once (in the weights below)")
        derived.append(Derived("vision tower", f"{_gib(on_card)} + {encoder_cache // memory.MiB} MiB encoder cache",
                               f"{where}; 1 image per prompt of at most {knobs.VISION_IMAGE_TOKENS:,} tokens "
                               f"({knobs.VISION_MAX_PIXELS:,} pixels); the encoder outputs vLLM profiles beside the "
                               "activation peak"))
    kv_mem = v.kv_mem if isinstance(v.kv_mem, int) else None
    if v.kv_mem == "auto":
        kv_mem = _auto_pool(v, probe, weights, encoder_cache, notes)
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
        longest = cache.longest_context(kv_mem)
        if not longest:  # a lower MAX_LEN cannot help: what a request holds before its first token fills the pool
            window = cache.spec == "dflash2"
            held = "state pages" + (f" and drafter window, in blocks of {cache.window_block_size} tokens" if window
                                    else "")
            _refuse(f"no context fits one request in a {kv_mem / memory.GiB:.2f} GiB pool: its {held} "
                    f"({cache.resident_bytes() / memory.GiB:.2f} GiB) leave no block for it; raise KV_MEM"
                    + (" or set DFLASH_TOKENS=7 (docs/long-context.md)" if window else ""))
        _refuse(f"MAX_LEN={max_len} does not fit one request in a {kv_mem / memory.GiB:.2f} GiB pool "
                f"(longest that fits: {longest}); lower MAX_LEN or raise KV_MEM")
    if cache and kv_mem is not None and v.max_seqs > cache.num_blocks(kv_mem):
        # vLLM 0.28.0 stops at CUDA-graph capture: every decode sequence needs a GDN state block (H200, 2026-11-29)
        _refuse(f"MAX_SEQS={v.max_seqs} is more than the {cache.num_blocks(kv_mem)} blocks of a "
                f"{kv_mem / memory.GiB:.2f} GiB pool (vLLM needs one GDN state block per sequence); lower MAX_SEQS "
                "or raise KV_MEM")
    if kv_mem is None and v.kv_mem == "":
        derived.append(Derived("pool", f"--gpu-memory-utilization {v.gpu_util}", "KV_MEM empty: vLLM sizes it"))
    return Sized(model, max_len, kv_mem, kv_dtype, backend, batched_tokens), cache, weights


def _vision_offload_gib(value: Callable[[str], object]) -> float | None:
    """VISION_OFFLOAD=1's budget, which the memory model counts for the tower (None: the whole tower); `value`
    reads a knob by name."""
    return float(value("VISION_OFFLOAD_GIB")) if value("VISION") and value("VISION_OFFLOAD") else None


def _encoder_cache(mode: str, vision: bool) -> int:
    """VISION=1: the encoder cache vLLM profiles (memory.encoder_cache_bytes); 0 without the tower."""
    batched = memory.PREFILL_CHUNK if mode == "single" else VLLM_BATCHED_TOKENS
    return memory.encoder_cache_bytes(batched, knobs.VISION_IMAGE_TOKENS) if vision else 0


def _auto_pool(v: Values, probe: Probe, weights: float, encoder_cache: int, notes: list[str]) -> int:
    """KV_MEM=auto: what the card with the least free VRAM leaves (vLLM gives every card the same pool)."""
    cards = probe.gpus()
    if not cards:
        _refuse(f"KV_MEM=auto needs the free VRAM and {probe.vram_source}; set KV_MEM to bytes "
                "(5583457484 = 5.2 GiB) or leave it empty to size the pool from GPU_UTIL")
    if len(cards) < v.tp:
        _refuse(f"TP={v.tp} needs {v.tp} cards and {probe.vram_source} sees {len(cards)}; set TP={len(cards)}, or make "
                f"{v.tp} cards visible (CUDA_VISIBLE_DEVICES, docker-compose.yml's GPU count)")
    free = min(f for f, _ in cards)
    kv_mem = memory.auto_kv_mem(free, weights, tp=v.tp, encoder_cache=encoder_cache)
    per = " per card" if v.tp > 1 else ""
    comm = f" - {_gib(memory.TP_COMM_BYTES)} communicators" if v.tp > 1 else ""
    encoder = f" - {_gib(encoder_cache)} encoder cache" if encoder_cache else ""
    notes.append(f"KV_MEM=auto -> {kv_mem} bytes ({kv_mem / memory.GiB:.2f} GiB{per}): {_gib(free)} free "
                 f"- {_gib(weights)} weights - {_gib(memory.CUDAGRAPH_BYTES)} graphs - "
                 f"{_gib(memory.ACTIVATION_PEAK_BYTES)} activation peak{comm}{encoder} - "
                 f"{_gib(memory.AUTO_MARGIN_BYTES)} margin")
    if len({f for f, _ in cards}) > 1 or len(cards) > v.tp:
        listed = ", ".join(f"{_gib(f)}" for f, _ in cards)
        notes.append(f"KV_MEM=auto: the {len(cards)} visible cards have {listed} free; the smallest ({_gib(free)}) "
                     "decides, since vLLM gives every card the same pool"
                     + (f" (TP={v.tp} uses {v.tp} of them: CUDA_VISIBLE_DEVICES picks which)" if len(cards) > v.tp else ""))
    return kv_mem


def _spec_tokens(v: Values) -> int:
    return {"mtp": v.draft_tokens, "dflash2": v.dflash_tokens}.get(v.spec, 0)


def _cache_lines(cache: memory.CacheShape, v: Values, sized: Sized) -> list[Derived]:
    """What the pool holds: block size, groups, the state page per resident, and the pool itself."""
    lines = [Derived("block size", f"{cache.block_size} tokens",
                     f"smallest multiple of {cache.block_alignment} whose page holds one GDN state (vLLM hybrid "
                     "alignment)"),
             Derived("KV groups", cache.groups, f"{cache.group_size} layers per group"),
             Derived("state page per resident", _gib(cache.resident_bytes()) + _per_card(v.tp),
                     f"(1+k) GDN state pages, k={_spec_tokens(v)}"
                     + (", +1 for prefix caching" if v.prefix_cache else "")
                     + (", + the drafter's window" if v.spec == "dflash2" else ""))]
    if sized.kv_mem is not None:
        lines += _pool_lines(cache, sized.kv_mem, sized.max_len, v.max_seqs)
    return lines


def _per_card(tp: int) -> str:
    return " per card" if tp > 1 else ""


def _card_lines(v: Values, model: str) -> list[Derived]:
    """TP > 1: what each card holds besides its share of the pool."""
    w = memory.weights(v.spec, fast_variant=(model == FAST_MODEL), vision=bool(v.vision),
                       vision_offload_gib=_vision_offload_gib(lambda name: getattr(v, name.lower())))
    whole = f" + {_gib(w.whole)} whole on every card (the DFlash2 drafter, the vision tower)" if w.whole else ""
    return [Derived("cards", v.tp, "--tensor-parallel-size: each card holds 1/TP of the KV heads, the GDN state, "
                                   "the linears and the vocabulary rows"),
            Derived("weights per card", _gib(w.per_card(v.tp)), f"{_gib(w.split)} split {v.tp} ways{whole}"),
            Derived("beside the pool per card", _gib(memory.beside_pool_bytes(v.tp)),
                    f"{_gib(memory.CUDAGRAPH_BYTES)} graphs + {_gib(memory.ACTIVATION_PEAK_BYTES)} activation peak "
                    f"(one card's figures, kept whole: an upper bound) + {_gib(memory.TP_COMM_BYTES)} communicators "
                    "(an allowance, not measured)")]


def _refuse(message: str) -> None:
    raise PlanError(message)


def _gib(n: float) -> str:
    return f"{n / memory.GiB:.2f} GiB"


def _pool_lines(cache: memory.CacheShape, kv_mem: int, max_len: int, seats: int) -> list[Derived]:
    per = _per_card(cache.tp)
    out = [Derived("pool", f"{cache.pool_tokens(kv_mem, max_len):,} tokens at {max_len:,} max-model-len",
                   f"{kv_mem / memory.GiB:.2f} GiB{per} / {cache.bytes_per_token(kv_mem, max_len) / 1024:.1f} KiB per "
                   f"token{per} (vLLM 0.28.0's capacity arithmetic)"),
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
        elif setting.source == "plan" and setting.rule:
            why = f"set by the plan: {setting.rule.why}"
        elif setting.rule and setting.rule.describe():
            why = f"default because {setting.rule.describe()}" + (f" ({setting.rule.why})" if setting.rule.why else "")
        else:
            why = "default"
        lines.append(f"{name:32} = {setting.value!s:24} {why}")
    lines.append("# derived")
    for d in plan.derived:
        lines.append(f"{d.name:32} = {d.value!s:24} {d.why}")
    tp = plan.value("TP")
    cards = probe.gpus()
    lines.append("# this card" if tp == 1 and len(cards) <= 1 else "# these cards")
    if not cards:
        lines.append(f"{'free VRAM':32} = {'unknown':24} {probe.vram_source}")
    else:
        for i, (free, total) in enumerate(cards):
            name = "free VRAM" if len(cards) == 1 else f"free VRAM, card {i}"
            lines.append(f"{name:32} = {_gib(free):24} of {_gib(total)} "
                         f"({probe.vram_source}; what the desktop or WSL2 holds is already taken out)")
        if len(cards) < tp:
            lines.append(f"{'cards':32} = {len(cards):<24} TP={tp} needs {tp}: vLLM will not start")
        elif len({f for f, _ in cards}) > 1:
            lines.append(f"{'card that decides':32} = {_gib(min(cards)[0]):24} the smallest free: every card gets "
                         "the same pool")
        if plan.cache and len(cards) >= tp:
            spec = plan.value("SPEC") if "SPEC" in plan.settings else "off"
            weights = memory.weights_bytes(spec, fast_variant=FAST_MODEL in plan.argv[2],
                                           vision=bool(plan.value("VISION")), tp=tp,
                                           vision_offload_gib=_vision_offload_gib(plan.value))
            encoder_cache = _encoder_cache(plan.mode, bool(plan.value("VISION")))
            fit = memory.auto_kv_mem(min(cards)[0], weights, tp=tp, encoder_cache=encoder_cache)
            comm = " - communicators" if tp > 1 else ""
            comm += " - encoder cache" if encoder_cache else ""
            lines.append(f"{'KV_MEM=auto would pin':32} = {_gib(fit) + _per_card(tp):24} free - weights - graphs - "
                         f"activation peak{comm} - {_gib(memory.AUTO_MARGIN_BYTES)} margin")
            if fit > 0:
                lines += [f"  {d.name:30} = {d.value!s:24} {d.why}"
                          for d in _pool_lines(plan.cache, fit, plan.value("MAX_LEN"), plan.value("MAX_SEQS"))]
    if plan.missing:
        lines.append("# first start would run")
        lines += [f"{step.command}    # {step.what}" for step in plan.missing]
    lines.append("# not checked yet")
    lines += [f"{what:32} = {'not checked yet':24} {why}" for what, why in unchecked(plan, probe)]
    return lines


def unchecked(plan: ServePlan, probe: Probe) -> list[tuple[str, str]]:
    """What this plan took on trust: the names vLLM accepts were checked against vllm_028 (what the plan knows of
    0.28.0), the same before install as after; what no list can tell is named here."""
    out = [("vLLM install", f"the plan checks names against vLLM {vllm_028.VERSION}'s, not the install; verify.sh "
                            "checks the installed version and patch series")]
    if probe.free_vram is None:
        out.append(("GPU and free VRAM", probe.vram_source))
    if plan.value("TP") > 1:
        out.append((f"TP={plan.value('TP')} on GPUs", "no run of this project's has served TP > 1 yet: the per-card "
                                                   "figures are the memory model's"))
    if not (_in_repo(probe, plan.served) / "config.json").is_file():
        out.append(("checkpoint contents", f"{plan.served} is not there yet; prepare_status checks it once it is"))
    return out


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
