"""Every launcher knob as data: type, default per mode and per CTX/SPEC, allowed values, one line of doc.

`python -m qwen_serving.knobs --markdown [--mode batch|single|common]` renders the tables the
READMEs carry (tests/test_knobs.py fails when a README drifts from this file).

Defaults are ordered rules: the first rule whose conditions all hold gives the value. Conditions
only name knobs listed earlier, so one pass in list order resolves everything (`resolve`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("batch", "single")
BASE_MODEL = "models/Qwen3.8-27B-W4A16-AutoRound"
FAST_MODEL = "models/Qwen3.8-27B-W4A16-AutoRound-fast"
DFLASH2_DRAFTER = "models/Qwen3.8-27B-DFlash2-W4A16"
KV_MEM_PINNED = 5_583_457_484  # 5.2 GiB: the DFlash2 pool, pinned by bytes (spec: deterministic boots)
KV_MEM_PINNED_HUGE = 5_261_334_937  # 4.90 GiB: the same for CTX=huge


class KnobError(ValueError):
    """A value a knob does not accept; the message names what to set instead."""


@dataclass(frozen=True)
class Ref:
    """A default that is another knob's resolved value."""

    knob: str


@dataclass(frozen=True)
class Above:
    """A rule condition: the knob's value is an integer above n."""

    n: int


def _holds(want: object, have: object) -> bool:
    if isinstance(want, Above):
        return isinstance(have, int) and have > want.n
    if isinstance(want, tuple):
        return have in want
    return have == want


@dataclass(frozen=True)
class Rule:
    value: object
    when: Mapping[str, object] = field(default_factory=dict)  # knob (or "mode") -> value, tuple or Above
    why: str = ""

    def matches(self, mode: str, resolved: Mapping[str, object]) -> bool:
        return all(_holds(want, mode if key == "mode" else resolved.get(key)) for key, want in self.when.items())

    def describe(self) -> str:
        parts = []
        for key, want in self.when.items():
            if key == "mode":
                continue
            if isinstance(want, Above):
                parts.append(f"{key}>{want.n}")
            elif isinstance(want, tuple):
                parts.append(f"{key}={'/'.join(map(str, want))}")
            else:
                parts.append(f"{key}={want}")
        return ", ".join(parts)


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise KnobError(f"not an integer: {text!r}") from None
        if lo is not None and value < lo or hi is not None and value > hi:
            raise KnobError(f"{value} is outside {lo}..{hi if hi is not None else 'inf'}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KnobError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise KnobError(f"{value} is not a fraction in (0, 1]")
    return value


def _flag(text: str) -> int:
    if text not in ("0", "1"):
        raise KnobError(f"{text!r} is not 0 or 1")
    return int(text)


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise KnobError(f"{text!r} is not one of {', '.join(values)}")
        return text

    parse.choices = values  # type: ignore[attr-defined]
    return parse


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise KnobError(f"{text!r} is not a regular expression: {e}") from None
    return text


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(|b|k|kib|m|mib|g|gib)\s*$", re.I)
_SCALE = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _bytes_or_auto(text: str) -> int | str:
    """KV_MEM: bytes (5583457484, 5.2GiB, 5300M), `auto`, or empty (size the pool from GPU_UTIL)."""
    if text in ("", "auto"):
        return text
    match = _SIZE.match(text)
    if not match:
        raise KnobError(f"{text!r} is not a size (bytes, or a number with M/MiB/G/GiB), 'auto' or empty")
    value = int(float(match.group(1)) * _SCALE[match.group(2).lower()])
    if value < 256 << 20:
        raise KnobError(f"{text!r} is below 256 MiB; no useful pool fits")
    return value


def _host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise KnobError(f"{text!r} is not a host name or address")
    if not re.fullmatch(r"[A-Za-z0-9.:\-\[\]]+", text):
        raise KnobError(f"{text!r} is not a host name or address")
    return text


def _args(text: str) -> str:
    try:
        shlex.split(text)
    except ValueError as e:
        raise KnobError(f"cannot split {text!r} like a shell would: {e}") from None
    return text


def _text(text: str) -> str:
    if not text:
        raise KnobError("empty")
    return text


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], object]
    defaults: tuple[Rule, ...]
    doc: str
    modes: tuple[str, ...] = MODES
    env: str = ""  # exported to vLLM under this name when the plan uses it

    def default(self, mode: str, resolved: Mapping[str, object]) -> tuple[object, Rule]:
        for rule in self.defaults:
            if rule.matches(mode, resolved):
                value = resolved[rule.value.knob] if isinstance(rule.value, Ref) else rule.value
                return value, rule
        raise AssertionError(f"{self.name}: no default rule matched in mode {mode}")

    def default_text(self, mode: str) -> str:
        """The default column of the README table for one mode (unreachable rules left out)."""
        names = {k.name for k in knobs_for(mode)}
        parts = []
        for rule in self.defaults:
            if "mode" in rule.when and not _holds(rule.when["mode"], mode):
                continue
            conditions = [key for key in rule.when if key != "mode"]
            if any(key not in names for key in conditions):
                continue
            value = rule.value
            shown = f"={value.knob}" if isinstance(value, Ref) else ("(empty)" if value == "" else str(value))
            cond = rule.describe()
            parts.append(f"`{shown}` ({cond})" if cond else f"`{shown}`")
            if not conditions:
                break
        return "; ".join(parts)


def _rules(*rules: Rule) -> tuple[Rule, ...]:
    return rules


LOOKUP_SUBKNOBS = (
    ("NMIN", 6, "shortest generated suffix that may match in the request's history"),
    ("NMAX", 12, "longest suffix tried; the longest match wins, ties go to the most recent"),
    ("NSTRONG", 6, "match length trusted on its own"),
    ("AGREE", 0, "leading tokens the drafter must also propose before a shorter match is taken"),
    ("NMIN_TAIL", 4, "the same bar for verify positions the drafter never proposes"),
    ("ADAPTIVE", 1, "1: schedule the long verify block only while a copy is running; 0: always"),
    ("LONGMIN", 6, "match length that counts as a fillable tail"),
    ("STICKY", 3, "steps the long block is held after the flag drops (one request in flight only)"),
    ("CHEAP_CTX", 0, "context length below which the long block is always taken (0 = off)"),
)

SINGLE = ("single",)
BATCH = ("batch",)

KNOBS: tuple[Knob, ...] = (
    Knob("HOST", _host, _rules(Rule("127.0.0.1")),
         "bind address; anything but loopback is refused without an API key (VLLM_API_KEY or api_key.txt)"),
    Knob("PUBLISHED_ON", _text, _rules(Rule(Ref("HOST"))),
         "where the port is reachable from, if not HOST: docker-compose.yml binds 0.0.0.0 inside the container "
         "and sets this to the host address it publishes on; the API-key rule applies to it"),
    Knob("PORT", _int(1, 65535), _rules(Rule(18020)), "HTTP port of the OpenAI-compatible API"),
    Knob("SPEC", _choice("mtp", "dflash2", "off"), _rules(Rule("mtp")),
         "speculative decoding: MTP head (k chained drafts), DFlash2 block drafter (7 drafts in one pass, "
         "one-user mode: 0.88 GiB of state pages per resident request), or none", SINGLE),
    Knob("CTX", _choice("fast", "long", "huge"), _rules(Rule("fast")),
         "`fast`: bf16 KV, FlashAttention, 64k; `long`: 150k (MTP: fp8 KV on FlashInfer, 3 drafts; DFlash2: "
         "int8 per-token-head KV on Triton); `huge`: KVarN 4/2-bit KV, 200-245k, needs `bash kvarn/install.sh`",
         SINGLE),
    Knob("KV", _choice("fp8", "int4pth", "kvarn"), _rules(Rule("fp8")),
         "KV cache: `fp8`; `int4pth` = vLLM's int4 per-token-head cache on the Triton backend; `kvarn` = the "
         "KVarN 4/2-bit cache (`bash kvarn/install.sh`)", BATCH),
    Knob("DFLASH_TOKENS", _int(7, 31), _rules(Rule(7)),
         "DFlash2 verify block; the drafter always proposes 7, positions past 7 are filled from the context "
         "(15 = reproduction mode: +47% when answers quote the prompt, half the seats)", SINGLE),
    Knob("DRAFT_TOKENS", _int(1, 8), _rules(
        Rule(3, {"CTX": ("long", "huge")}, "spec: k=4 dies with an illegal memory access on FlashInfer"),
        Rule(4)), "MTP drafts per step; 5 and 6 are slower", SINGLE),
    Knob("MAX_SEQS", _int(1, 1024), _rules(
        Rule(64, {"mode": "batch"}),
        Rule(2, {"CTX": "huge"}, "spec: 8 seats on CTX=huge preempts (10 preemptions, 40% less work done)"),
        Rule(4, {"SPEC": "dflash2", "DFLASH_TOKENS": Above(7)}, "spec: a 16-token block doubles the state page"),
        Rule(8)), "requests admitted at once (not how many the pool holds: `explain` prints the seats)"),
    Knob("DFLASH_MAX_LEN", _int(1024, 1 << 20), _rules(
        Rule(221_184, {"CTX": "huge", "DFLASH_TOKENS": Above(7)}, "spec 82bd62d: above 7 drafts 240k does not boot"),
        Rule(245_760, {"CTX": "huge"}),
        Rule(114_688, {"CTX": "long", "DFLASH_TOKENS": Above(7)}),
        Rule(131_072, {"CTX": "long"}),
        Rule(57_344, {"DFLASH_TOKENS": Above(7)}, "memory model: the longest context a 16-token block leaves in 5.2 GiB"),
        Rule(65_536)), "context length with SPEC=dflash2", SINGLE),
    Knob("MAX_LEN", _int(1024, 1 << 20), _rules(
        Rule(262_144, {"mode": "batch", "KV": ("int4pth", "kvarn")}),
        Rule(150_000, {"mode": "batch"}),
        Rule(Ref("DFLASH_MAX_LEN"), {"SPEC": "dflash2"}),
        Rule(200_000, {"CTX": "huge"}),
        Rule(150_000, {"CTX": "long"}),
        Rule(65_536)), "max-model-len: the longest prompt + answer one request may have"),
    Knob("KV_MEM", _bytes_or_auto, _rules(
        Rule(KV_MEM_PINNED_HUGE, {"mode": "single", "SPEC": "dflash2", "CTX": "huge"}),
        Rule(KV_MEM_PINNED, {"mode": "single", "SPEC": "dflash2"},
             "spec: the V2 runner's activation peak swings ~1 GiB between starts; pin the pool by bytes"),
        Rule("")), "KV pool in bytes (`5.2GiB` works); `auto` sizes it from free VRAM; empty: from GPU_UTIL"),
    Knob("DRAFT", _text, _rules(Rule(DFLASH2_DRAFTER)), "DFlash2 drafter dir (`prepare/fetch_dflash2.py`)",
         SINGLE),
    Knob("DRAFT_SAMPLE", _choice("probabilistic", "greedy"), _rules(Rule("probabilistic")),
         "MTP draft sampling; `greedy` is the same at T=0 and ~15% slower at T>0", SINGLE),
    Knob("LOOKUP", _flag, _rules(Rule(1)),
         "SPEC=dflash2: draft from the request's own context and fill the verify positions past the "
         "drafter's 7 (sub-knobs: VLLM_DFLASH2_LOOKUP_*)", SINGLE, env="VLLM_DFLASH2_LOOKUP"),
    *(Knob(f"VLLM_DFLASH2_LOOKUP_{name}", _int(0, 1 << 20), _rules(Rule(value)), doc, SINGLE,
           env=f"VLLM_DFLASH2_LOOKUP_{name}") for name, value, doc in LOOKUP_SUBKNOBS),
    Knob("SPEC_ATTN", _flag, _rules(Rule(1, {"CTX": "fast"}), Rule(0)),
         "split-KV Triton attention for the multi-query verify step (FlashAttention backend)", SINGLE,
         env="VLLM_SPEC_DECODE_ATTN"),
    Knob("MTP_DRAFT_VOCAB", _flag, _rules(Rule(1)),
         "SPEC=mtp: draft over the 40k-token head built by prepare/build_draft_vocab.py; 0 = full lm_head",
         SINGLE, env="VLLM_MTP_DRAFT_VOCAB"),
    Knob("PREFIX_CACHE", _flag, _rules(Rule(1)),
         "hybrid prefix caching (`--enable-prefix-caching --mamba-cache-mode align`): 20x faster follow-up "
         "turns, one more state page per request; 0 passes `--no-enable-prefix-caching`"),
    Knob("INT8_ACT", _choice("int8", "off"), _rules(Rule("int8", {"mode": "batch"}), Rule("off")),
         "W4A8: int8 activations on int8 tensor cores for the layers INT8_LAYERS selects",
         env="VLLM_MARLIN_INPUT_DTYPE"),
    Knob("INT8_LAYERS", _regex, _rules(Rule("mlp", {"mode": "batch"}), Rule("mlp|linear_attn|self_attn")),
         "regex over layer names that get int8 activations; `.` = all (batch: needs GPU_UTIL 0.95); "
         "`mlp|linear_attn` crashes inductor on this pin", env="VLLM_MARLIN_INT8_INCLUDE_RE"),
    Knob("PREFILL_ATTN", _choice("int8", "off"), _rules(Rule("off")),
         "int8-QK prefill attention for single-request chunks; pair it with INT8_ACT=int8", SINGLE,
         env="VLLM_PREFILL_INT8_ATTN"),
    Knob("GPU_UTIL", _fraction, _rules(
        Rule(0.95, {"mode": "batch", "INT8_LAYERS": "."}, "spec: all-layer int8 needs GPU_UTIL=0.95"),
        Rule(0.972, {"mode": "batch"}),
        Rule(0.93)), "--gpu-memory-utilization when KV_MEM is empty; batch's 0.972 OOMs the MTP path"),
    Knob("STATE_DTYPE", _choice("float16", "bfloat16", "float32"), _rules(Rule("float16")),
         "GDN recurrent-state dtype: float16 halves the state (spec: 37 -> 64 resident requests)"),
    Knob("TOOLS", _flag, _rules(Rule(1)), "tool calling (`--enable-auto-tool-choice`); 0 = off"),
    Knob("TOOL_PARSER", _text, _rules(Rule("qwen3_coder")),
         "must read the XML calls this model's template emits; `hermes` reads JSON and fails silently"),
    Knob("VISION", _flag, _rules(Rule(0)),
         "1 keeps the vision tower (0.858 GiB) instead of `--language-model-only`; one image per prompt"),
    Knob("VISION_OFFLOAD", _flag, _rules(Rule(1)),
         "VISION=1: keep the tower in pinned host RAM, copy each module in for its forward (SPEC=dflash2 "
         "VISION=1 does not boot on 24 GB without it)", env="VLLM_VISION_CPU_OFFLOAD"),
    Knob("REQ_METRICS", _flag, _rules(Rule(0)),
         "1 = `--enable-per-request-metrics --enable-force-include-usage` (not with --disable-log-stats)"),
    Knob("API_SERVERS", _int(1, 64), _rules(Rule(1)), "--api-server-count: HTTP front-end processes"),
    Knob("ASYNC_SCHED", _flag, _rules(
        Rule(0, {"SPEC": "dflash2"}, "the verify-block length feeds back to the scheduler on the sync path only"),
        Rule(1)), "async scheduling"),
    Knob("CUDAGRAPH_MODE", _choice("auto", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE"),
         _rules(Rule("PIECEWISE", {"SPEC": "mtp", "CTX": "huge"},
                     "spec: under FULL one prompt length in 128 comes back corrupted on a prefix-cache hit"),
                Rule("auto")), "CUDA-graph capture mode; `auto` leaves it to vLLM"),
    Knob("GDN_PREFILL", _choice("auto", "triton", "flashinfer", "cutedsl"), _rules(Rule("auto")),
         "--gdn-prefill-backend; `triton` where FlashInfer is not installed (sm90 picks FlashInfer)"),
    Knob("MODEL", _text, _rules(
        Rule("auto", {"mode": "single"}),
        Rule(BASE_MODEL)), f"checkpoint dir; single `auto` = `{FAST_MODEL}` if present, else `{BASE_MODEL}`"),
    Knob("EXTRA_ARGS", _args, _rules(Rule("")), "appended to the vllm argv as is (e.g. `--tensor-parallel-size 2`)"),
)

BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
SECRET_ENV = "VLLM_API_KEY"


def knobs_for(mode: str) -> tuple[Knob, ...]:
    return tuple(k for k in KNOBS if mode in k.modes)


@dataclass(frozen=True)
class Setting:
    value: object
    source: str  # "env" or "default"
    rule: Rule | None = None


def resolve(mode: str, env: Mapping[str, str]) -> dict[str, Setting]:
    """Parse every knob of `mode` from env (an empty value counts as unset, except KV_MEM)."""
    if mode not in MODES:
        raise KnobError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    out: dict[str, Setting] = {}
    values: dict[str, object] = {}
    for knob in knobs_for(mode):
        raw = env.get(knob.name)
        if raw is not None and (raw != "" or knob.name in ("KV_MEM", "EXTRA_ARGS")):
            try:
                value = knob.parse(raw)
            except KnobError as e:
                raise KnobError(f"{knob.name}={raw!r}: {e}. {knob.name}: {knob.doc}") from None
            out[knob.name] = Setting(value, "env")
        else:
            value, rule = knob.default(mode, values)
            out[knob.name] = Setting(value, "default", rule)
        values[knob.name] = value
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(mode: str) -> str:
    """The knob table of one mode (`common` = knobs both modes share, default columns side by side)."""
    if mode == "common":
        lines = ["| var | batch default | single-user default | notes |", "|---|---|---|---|"]
        for k in KNOBS:
            if k.modes == MODES:
                lines.append(f"| `{k.name}` | {_cell(k.default_text('batch'))} | {_cell(k.default_text('single'))} "
                             f"| {_cell(k.doc)} |")
        lines.append(f"| `{SECRET_ENV}` | (unset) | (unset) | API key, else the first line of `api_key.txt`; "
                     "passed to vLLM through the environment, never in the argv |")
        return "\n".join(lines) + "\n"
    lines = ["| var | default | notes |", "|---|---|---|"]
    for k in knobs_for(mode):
        lines.append(f"| `{k.name}` | {_cell(k.default_text(mode))} | {_cell(k.doc)} |")
    return "\n".join(lines) + "\n"


BLOCK = re.compile(r"(<!-- knobs:begin -->\n)(.*?)(<!-- knobs:end -->)", re.S)


def update_readme(path: Path, mode: str) -> bool:
    """Replace the table between the knobs markers of `path` (written atomically); True if it changed."""
    text = path.read_text()
    if not BLOCK.search(text):
        raise KnobError(f"{path} has no <!-- knobs:begin --> / <!-- knobs:end --> lines to fill")
    new = BLOCK.sub(lambda m: m.group(1) + markdown(mode) + m.group(3), text, count=1)
    if new == text:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen_serving.knobs", description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the knob table")
    ap.add_argument("--mode", choices=("batch", "single", "common"), default="common")
    ap.add_argument("--update", type=Path, metavar="README", help="rewrite the table inside README's knobs markers")
    args = ap.parse_args(argv)
    if not args.markdown:
        ap.print_help()
        return 2
    if args.update:
        changed = update_readme(args.update, args.mode)
        print(f"{args.update}: {'updated' if changed else 'already current'}")
        return 0
    sys.stdout.write(markdown(args.mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
