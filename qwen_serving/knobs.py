"""Every launcher knob as data: type, default per mode and per CTX/SPEC, allowed values, one line of doc,
how it reaches vLLM (argv flags or an exported variable) and the cross-knob rules, each with its why.

`python -m qwen_serving.knobs --markdown [--mode batch|single|common]` renders the tables the
READMEs carry (tests/test_knobs.py fails when a README drifts from this file).

Defaults are ordered rules: the first rule whose conditions all hold gives the value. Conditions
only name knobs listed earlier, so one pass in list order resolves everything (`resolve`). A `Limit`
is a default that is also a bound: the same datum gives the value where its conditions hold and the
refusal (or warning) for a value set by hand that breaks it. `CHECKS` holds the refusals and warnings
not tied to one default. `render` turns the resolved values into the argv and the exports; plan.py
adds only what depends on the machine (files, free VRAM, the API key).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import files, model

MODES = ("batch", "single")
BASE_MODEL = "models/Qwen3.8-27B-W4A16-AutoRound"
FAST_MODEL = "models/Qwen3.8-27B-W4A16-AutoRound-fast"
DFLASH2_DRAFTER = "models/Qwen3.8-27B-DFlash2-W4A16"
DRAFT_IDS = "prepare/draft_vocab_ids.json"  # the draft-vocabulary list calibrate.sh writes (none ships)
KV_MEM_PINNED = 5_583_457_484  # 5.2 GiB: the DFlash2 pool, pinned by bytes (spec: deterministic boots)
KV_MEM_PINNED_HUGE = 5_261_334_937  # 4.90 GiB: the same for CTX=huge
SERVED_NAME = "qwen3.8-27b"
API_KEY_FILE = "api_key.txt"
VISION_IMAGE_TOKENS = 2048  # the pixel cap VISION=1 sets, in image tokens
VISION_MAX_PIXELS = VISION_IMAGE_TOKENS * 32 * 32  # one image token per 32x32 pixels (16-pixel patches, 2x2 merge)
VISION_OFFLOAD_ENV = "VLLM_VISION_OFFLOAD"  # read by patches/vision-offload.patch (engine/vision_offload.py)
VISION_OFFLOAD_GIB = 0.125  # the default budget: the merger stays on the card, the 27 blocks stream
VISION_OFFLOAD_MIN_GIB = math.ceil(model.vision_offload_floor_bytes() / (1 << 30) * 1000) / 1000  # 0.093
LOOKUP_ENV = "VLLM_DFLASH2_LOOKUP"  # read by patches/dflash2-lookup.patch (engine/spec_dflash2_lookup.py)
LOOKUP_MAX_NMAX = 64  # the lookup kernel unrolls its match loop NMAX times
LOOKUP_PARAMS = (  # (variable, largest value, default, what it sets): the spec's values
    (f"{LOOKUP_ENV}_NMIN", LOOKUP_MAX_NMAX, 6, "shortest suffix of the history that may match"),
    (f"{LOOKUP_ENV}_NMAX", LOOKUP_MAX_NMAX, 12, "longest suffix tried"),
    (f"{LOOKUP_ENV}_NSTRONG", LOOKUP_MAX_NMAX + 1, 8, "a match this long is taken without the drafter agreeing"),
    (f"{LOOKUP_ENV}_AGREE", 31, 2, "a shorter match needs the drafter's first AGREE drafts to equal it"),
)
LOOKUP_STICKY = f"{LOOKUP_ENV}_STICKY"  # read by patches/dflash2-verify-block.patch (engine/spec_verify_block.py)


class KnobError(ValueError):
    """A value a knob does not accept; the message names what to set instead."""


@dataclass(frozen=True)
class Ref:
    """A default that is another knob's resolved value."""

    knob: str


@dataclass(frozen=True)
class Above:
    """A condition: the knob's value is a number above n."""

    n: float


@dataclass(frozen=True)
class Not:
    """A condition: the inner condition does not hold."""

    want: object


def at_most(n: float) -> Not:
    return Not(Above(n))


@dataclass(frozen=True)
class Alternatives:
    """A condition on a regex knob: its `|` alternatives are exactly these, in any order."""

    names: frozenset[str]


@dataclass(frozen=True)
class HasArg:
    """A condition on EXTRA_ARGS: it carries this flag or one of its other spellings (alone or as `flag=value`)."""

    flag: str
    also: tuple[str, ...] = ()


SET = "<set in the environment>"  # a condition: the knob was set by hand, whatever its value


def holds(want: object, have: object) -> bool:
    """Whether the value `have` meets the condition `want` (a value, a tuple of values, or one of the above)."""
    if isinstance(want, Above):
        return isinstance(have, int | float) and have > want.n
    if isinstance(want, Not):
        return not holds(want.want, have)
    if isinstance(want, Alternatives):
        return isinstance(have, str) and set(have.split("|")) == want.names
    if isinstance(want, HasArg):
        flags = (want.flag, *want.also)
        return isinstance(have, str) and any(a == f or a.startswith(f + "=") for a in shlex.split(have) for f in flags)
    if isinstance(want, tuple):
        return have in want
    return have == want


@dataclass(frozen=True)
class Rule:
    value: object
    when: Mapping[str, object] = field(default_factory=dict)  # knob (or "mode") -> value, tuple or Above
    why: str = ""

    def matches(self, mode: str, resolved: Mapping[str, object]) -> bool:
        return all(holds(want, mode if key == "mode" else resolved.get(key)) for key, want in self.when.items())

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


@dataclass(frozen=True)
class Check:
    """A combination that is refused (or, with warn, warned about). `message` is the reason and the fix,
    formatted with the knob values ({MAX_SEQS} is MAX_SEQS's value)."""

    when: Mapping[str, object]  # knob (or "mode") -> condition, or SET
    message: str
    warn: bool = False

    def applies(self, mode: str, values: Mapping[str, object], explicit: frozenset[str]) -> bool:
        return all(key in explicit if want == SET else holds(want, mode if key == "mode" else values.get(key))
                   for key, want in self.when.items())


@dataclass(frozen=True)
class Limit(Rule):
    """A default that is also a bound: where `when` holds the knob defaults to `value`, and a value that
    does not meet `allowed` where `checked_when` (default: `when`) holds is refused, or warned about."""

    allowed: object = None
    message: str = ""
    warn: bool = False
    checked_when: Mapping[str, object] | None = None

    def check(self, knob: str) -> Check:
        where = self.when if self.checked_when is None else self.checked_when
        return Check({**where, knob: Not(self.allowed)}, self.message, self.warn)


Parser = Callable[[str], object]


def _samples(parse: Parser, *values: str) -> Parser:
    """Record values a parser accepts, beside its default: tests try each knob at them."""
    parse.samples = values  # type: ignore[attr-defined]
    return parse


def _int(lo: int | None = None, hi: int | None = None) -> Parser:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise KnobError(f"not an integer: {text!r}") from None
        if lo is not None and value < lo or hi is not None and value > hi:
            raise KnobError(f"{value} is outside {lo}..{hi if hi is not None else 'inf'}")
        return value

    return _samples(parse, *(str(n) for n in (lo, hi) if n is not None))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KnobError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise KnobError(f"{value} is not a fraction in (0, 1]")
    return value


def _gib_at_least(lo: float) -> Parser:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise KnobError(f"not a number of GiB: {text!r}") from None
        if not lo <= value < math.inf:
            raise KnobError(f"{value:g} GiB is below {lo:g}, the least the vision tower needs on the card at once")
        return value

    return _samples(parse, "0.25", "1")


def _bit(text: str) -> int:
    if text not in ("0", "1"):
        raise KnobError(f"{text!r} is not 0 or 1")
    return int(text)


def _choice(*values: str) -> Parser:
    def parse(text: str) -> str:
        if text not in values:
            raise KnobError(f"{text!r} is not one of {', '.join(values)}")
        return text

    parse.choices = values  # type: ignore[attr-defined]
    return _samples(parse, *values)


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


_samples(_fraction, "0.5", "1.0")
_bit.choices = ("0", "1")  # type: ignore[attr-defined]
_samples(_bit, "0", "1")
_samples(_regex, ".", "mlp")
_samples(_bytes_or_auto, "", "auto", "6GiB")
_samples(_host, "0.0.0.0", "::1")
_samples(_args, "--seed 1")
_samples(_text, "elsewhere")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Sized:
    """What the plan works out from the machine before rendering: the checkpoint dir, the context
    after KV_MEM=auto fitting, the pool in bytes (None: vLLM sizes it from GPU_UTIL) and the KV layout."""

    model: str
    max_len: int
    kv_mem: int | None
    kv_dtype: str
    backend: str
    batched_tokens: int | None  # --max-num-batched-tokens, when the mode sets it


# A knob's argv: (its value, every knob's value, the sized pool) -> the arguments it adds.
Argv = Callable[[object, "Values", Sized], Sequence[str]]


def _opt(flag: str, unless: object = None) -> Argv:
    """`flag VALUE`, left out when the value is `unless` (vLLM's own default)."""
    return lambda value, v, z: [] if value == unless else [flag, str(value)]


def _switch(on: Sequence[str], off: Sequence[str] = ()) -> Argv:
    return lambda value, v, z: on if value else off


def _kv_args(value: object, v: Values, z: Sized) -> list[str]:
    return (["--kv-cache-dtype", z.kv_dtype] if z.kv_dtype != "auto" else []) + \
        (["--attention-backend", z.backend] if z.backend else [])


def _spec_args(value: object, v: Values, z: Sized) -> list[str]:
    if value == "mtp":
        config = {"method": "mtp", "num_speculative_tokens": v.draft_tokens, "draft_sample_method": v.draft_sample}
    elif value == "dflash2":
        config = {"method": "dflash", "model": v.draft, "num_speculative_tokens": v.dflash_tokens}
    else:
        return []
    return ["--speculative-config", json.dumps(config)]


@dataclass(frozen=True)
class Export:
    """An environment variable the knob sets for vLLM (and our patches) where `when` holds."""

    var: str
    when: Mapping[str, object] = field(default_factory=dict)  # knob -> condition, as in Rule.when
    text: Callable[[object], str] = str  # the exported string for the knob's value


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Parser
    defaults: tuple[Rule, ...]
    doc: str
    modes: tuple[str, ...] = MODES
    argv: Argv | None = None  # how the value becomes vllm arguments
    export: Export | None = None  # or an exported variable
    idle: object = None  # the value in a mode that does not offer the knob (None: its last default)

    def default(self, mode: str, resolved: Mapping[str, object]) -> tuple[object, Rule]:
        for rule in self.defaults:
            if rule.matches(mode, resolved):
                value = resolved[rule.value.knob] if isinstance(rule.value, Ref) else rule.value
                return value, rule
        raise AssertionError(f"{self.name}: no default rule matched in mode {mode}")

    @property
    def samples(self) -> tuple[str, ...]:
        """Values other than the default to try the knob at (from its parser)."""
        return self.parse.samples  # type: ignore[attr-defined]

    @property
    def choices(self) -> tuple[str, ...]:
        """Every value the knob takes, for a choice or a 0/1 knob; () for the others."""
        return getattr(self.parse, "choices", ())

    def idle_value(self) -> object:
        return self.defaults[-1].value if self.idle is None else self.idle

    def default_text(self, mode: str) -> str:
        """The default column of the README table for one mode (unreachable rules left out)."""
        names = {k.name for k in knobs_for(mode)}
        parts = []
        for rule in self.defaults:
            if "mode" in rule.when and not holds(rule.when["mode"], mode):
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


SINGLE = ("single",)
BATCH = ("batch",)
SPECULATING = ("mtp", "dflash2")

KNOBS: tuple[Knob, ...] = (
    Knob("HOST", _host, _rules(Rule("127.0.0.1")),
         "bind address; anything but loopback is refused without an API key (VLLM_API_KEY or api_key.txt)",
         argv=_opt("--host")),
    Knob("PUBLISHED_ON", _text, _rules(Rule(Ref("HOST"))),
         "where the port is reachable from, if not HOST: docker-compose.yml binds 0.0.0.0 inside the container "
         "and sets this to the host address it publishes on; the API-key rule applies to it"),
    Knob("PORT", _int(1, 65535), _rules(Rule(18020)), "HTTP port of the OpenAI-compatible API", argv=_opt("--port")),
    Knob("TP", _samples(_int(1, 8), "2", "4"), _rules(Rule(1)),
         "cards the model is split across (`--tensor-parallel-size`): 1, 2 or 4, what its 4 KV heads divide by; "
         "KV_MEM and GPU_UTIL are per card, and `explain` prints each card's share",
         argv=_opt("--tensor-parallel-size", unless=1)),
    Knob("SPEC", _choice("mtp", "dflash2", "off"), _rules(Rule("mtp")),
         "speculative decoding: MTP head (k chained drafts), DFlash2 block drafter (7 drafts in one pass, "
         "one-user mode: 0.88 GiB of state pages per resident request), or none", SINGLE,
         argv=_spec_args, idle="off"),
    Knob("CTX", _choice("fast", "long", "huge"), _rules(Rule("fast")),
         "`fast`: bf16 KV, FlashAttention, 64k; `long`: 150k (MTP: fp8 KV on FlashInfer, 3 drafts; DFlash2: "
         "int8 per-token-head KV on Triton); `huge`: vLLM's int4 per-token-head KV on Triton, 262k (DFlash2: 245k), "
         "2 seats (docs/long-context.md)",
         SINGLE, argv=_kv_args),
    Knob("KV", _choice("fp8", "int4pth"), _rules(Rule("fp8")),
         "KV cache: `fp8`; `int4pth` = vLLM's int4 per-token-head cache on the Triton backend (262k)", BATCH,
         argv=_kv_args),
    Knob("DFLASH_TOKENS", _int(7, 31), _rules(Rule(7)),
         "DFlash2 verify block (vLLM's num_speculative_tokens); the drafter proposes 7. Above 7 the lookup fills the "
         "positions past them and the long block is verified only while a copy runs, the drafter's 7 otherwise (the "
         "spec's reproduction mode at 15: +47% when answers quote the prompt, half the seats); scripted model, H200: "
         "16 tokens a step while copying, 1.87x the 7-draft server",
         SINGLE),
    Knob("DRAFT_TOKENS", _int(1, 8), _rules(
        Limit(3, {"SPEC": "mtp", "CTX": "long"}, "spec: k=4 dies with an illegal memory access on FlashInfer",
              allowed=at_most(3),
              message="DRAFT_TOKENS={DRAFT_TOKENS} on CTX=long: FlashInfer's spec-decode path dies with an illegal "
                      "memory access with 4 drafts once requests finish mid-batch (spec); set DRAFT_TOKENS=3 (or 2), "
                      "or CTX=fast for 4 drafts"),
        Rule(3, {"SPEC": "mtp", "CTX": "huge"}, "spec: CTX=huge runs 3 drafts"),
        Rule(4)), "MTP drafts per step; 5 and 6 are slower", SINGLE),
    Knob("MAX_SEQS", _int(1, 1024), _rules(
        Rule(64, {"mode": "batch"}),
        Rule(2, {"CTX": "huge"}, "spec: 8 seats on CTX=huge preempts (10 preemptions, 40% less work done)"),
        Limit(4, {"SPEC": "dflash2", "DFLASH_TOKENS": Above(7)}, "spec: a 16-token block doubles the state page",
              allowed=at_most(4),
              message="DFLASH_TOKENS={DFLASH_TOKENS} with MAX_SEQS={MAX_SEQS}: a long verify block doubles every "
                      "resident's state page and this boots, then dies on the first concurrent batch (spec); set "
                      "MAX_SEQS=4 (or unset it) or DFLASH_TOKENS=7"),
        Rule(8)), "requests admitted at once (not how many the pool holds: `explain` prints the seats)",
        argv=_opt("--max-num-seqs")),
    Knob("DFLASH_MAX_LEN", _int(1024, 1 << 20), _rules(
        # each keyed on SPEC=dflash2 too, so no other plan prints a note for a value it never reads
        Rule(203_776, {"SPEC": "dflash2", "CTX": "huge", "DFLASH_TOKENS": Above(7)},
             "memory model: the longest context the 4.90 GiB pool holds above 7 drafts (spec: 240k does not boot)"),
        Rule(245_760, {"SPEC": "dflash2", "CTX": "huge"}),
        Rule(114_688, {"SPEC": "dflash2", "CTX": "long", "DFLASH_TOKENS": Above(7)},
             "memory model: 8 to 14 drafts hold it; at 15, 16, 18, 19, 28 and 29 no context fits (docs/long-context.md)"),
        Rule(131_072, {"SPEC": "dflash2", "CTX": "long"}),
        Rule(57_344, {"SPEC": "dflash2", "DFLASH_TOKENS": Above(7)},
             "memory model: the longest context a 16-token block leaves in 5.2 GiB"),
        Rule(65_536)), "context length with SPEC=dflash2", SINGLE),
    Knob("MAX_LEN", _int(1024, 1 << 20), _rules(
        Rule(262_144, {"mode": "batch", "KV": "int4pth"}),
        Rule(150_000, {"mode": "batch"}),
        Rule(Ref("DFLASH_MAX_LEN"), {"SPEC": "dflash2"}),
        Rule(262_144, {"CTX": "huge"}, "the model's whole context: int4 per-token-head holds it on a 24 GB card"),
        Rule(150_000, {"CTX": "long"}),
        Rule(65_536)), "max-model-len: the longest prompt + answer one request may have",
        argv=lambda value, v, z: ["--max-model-len", str(z.max_len)]),  # z.max_len: after KV_MEM=auto fitting
    Knob("KV_MEM", _bytes_or_auto, _rules(
        Rule(KV_MEM_PINNED_HUGE, {"mode": "single", "SPEC": "dflash2", "CTX": "huge"}),
        Rule(KV_MEM_PINNED, {"mode": "single", "SPEC": "dflash2"},
             "spec: the V2 runner's activation peak swings ~1 GiB between starts; pin the pool by bytes"),
        Rule("")), "KV pool in bytes (`5.2GiB` works); `auto` sizes it from free VRAM; empty: from GPU_UTIL",
        argv=lambda value, v, z: [] if z.kv_mem is None else ["--kv-cache-memory-bytes", str(z.kv_mem)]),
    Knob("DRAFT", _text, _rules(Rule(DFLASH2_DRAFTER)), "DFlash2 drafter dir (`prepare/fetch_dflash2.py`)",
         SINGLE),
    Knob("LOOKUP", _bit, _rules(
        Limit(1, {"SPEC": "dflash2", "DFLASH_TOKENS": Above(7)}, "only the lookup fills the block past the drafter's 7",
              allowed=(1,),
              message="LOOKUP=0 with DFLASH_TOKENS={DFLASH_TOKENS}: the drafter proposes 7 and only the lookup fills "
                      "the verify block past them; set LOOKUP=1 (or unset it) or DFLASH_TOKENS=7"),
        Rule(1)),
         "SPEC=dflash2: each step, the continuation of the latest earlier occurrence of the request's own last "
         "tokens replaces the drafter's drafts (a match of NSTRONG tokens alone, a shorter one where the drafter agrees "
         "on its first AGREE); exact (point-mass proposals); scripted model, H200: 2.9x LOOKUP=0 while copying",
         SINGLE,
         export=Export(LOOKUP_ENV, {"SPEC": "dflash2"})),
    *(Knob(var, _int(1, hi), _rules(Rule(default)), f"LOOKUP: {doc}", SINGLE,
           export=Export(var, {"SPEC": "dflash2", "LOOKUP": 1}))
      for var, hi, default, doc in LOOKUP_PARAMS),
    Knob(LOOKUP_STICKY, _int(0, 64), _rules(Rule(3)),
         "DFLASH_TOKENS above 7: steps the long verify block is held after the copy's flags drop, with one request "
         "in flight (the spec's 3)", SINGLE,
         export=Export(LOOKUP_STICKY, {"SPEC": "dflash2", "LOOKUP": 1})),
    Knob("DRAFT_SAMPLE", _choice("probabilistic", "greedy"), _rules(Rule("probabilistic")),
         "MTP draft sampling; `greedy` is the same at T=0 and ~15% slower at T>0", SINGLE),
    Knob("SPEC_ATTN", _bit, _rules(Rule(1, {"CTX": "fast"}), Rule(0)),
         "split-KV Triton attention for the multi-query verify step, where vLLM runs FlashAttention 2 (sm80/86/89; "
         "sm90's FA3 is faster and keeps it)", SINGLE,
         export=Export("VLLM_SPEC_DECODE_ATTN", {"SPEC": SPECULATING, "SPEC_ATTN": 1})),
    Knob("MTP_DRAFT_VOCAB", _bit, _rules(Rule(1)),
         "SPEC=mtp: draft over the 40k-token head in MODEL, built from DRAFT_IDS; 0 = the full lm_head (correct, "
         "slower drafts), what the plan picks when there is neither a head nor a list "
         "(`bash single-user/calibrate.sh` builds one)",
         SINGLE, export=Export("VLLM_MTP_DRAFT_VOCAB", {"SPEC": "mtp"})),
    Knob("DRAFT_IDS", _text, _rules(Rule(DRAFT_IDS)),
         "JSON list of token ids the first start builds the MTP draft head from when MODEL has none "
         "(`bash single-user/calibrate.sh` writes it); set, it must exist", SINGLE),
    Knob("PREFIX_CACHE", _bit, _rules(Rule(1)),
         "hybrid prefix caching (`--enable-prefix-caching --mamba-cache-mode align`): 20x faster follow-up "
         "turns, one more state page per request; 0 passes `--no-enable-prefix-caching`",
         # vLLM 0.28.0 turns prefix caching on for hybrids unless told not to
         argv=_switch(["--enable-prefix-caching", "--mamba-cache-mode", "align"], ["--no-enable-prefix-caching"])),
    Knob("INT8_ACT", _choice("int8", "off"), _rules(Rule("int8", {"mode": "batch"}), Rule("off")),
         "W4A8: int8 activations on int8 tensor cores for the layers INT8_LAYERS selects",
         export=Export("VLLM_MARLIN_INPUT_DTYPE", {"INT8_ACT": "int8"})),
    Knob("INT8_LAYERS", _regex, _rules(Rule("mlp", {"mode": "batch"}), Rule("mlp|linear_attn|self_attn")),
         "regex over layer names that get int8 activations; `.` = all (batch: needs GPU_UTIL 0.95); "
         "`mlp|linear_attn` crashes inductor on this pin", export=Export("VLLM_MARLIN_INT8_INCLUDE_RE", {"INT8_ACT": "int8"})),
    Knob("PREFILL_ATTN", _choice("int8", "off"), _rules(Rule("off")),
         "int8-QK prefill attention for single-request chunks; pair it with INT8_ACT=int8", SINGLE,
         export=Export("VLLM_PREFILL_INT8_ATTN", {"PREFILL_ATTN": "int8"}, lambda value: "1")),
    Knob("GPU_UTIL", _fraction, _rules(
        Limit(0.95, {"mode": "batch", "INT8_LAYERS": "."}, "spec: all-layer int8 needs GPU_UTIL=0.95",
              allowed=at_most(0.95), warn=True,
              message="INT8_LAYERS=. needs GPU_UTIL<=0.95 (spec), GPU_UTIL={GPU_UTIL} may not boot"),
        Rule(0.972, {"mode": "batch"}),
        Rule(0.93)), "--gpu-memory-utilization when KV_MEM is empty; batch's 0.972 OOMs the MTP path",
        argv=lambda value, v, z: [] if z.kv_mem is not None else ["--gpu-memory-utilization", str(value)]),
    Knob("STATE_DTYPE", _choice("float16", "bfloat16", "float32"), _rules(Rule("float16")),
         "GDN recurrent-state dtype: float16 halves the state (spec: 37 -> 64 resident requests)",
         argv=_opt("--mamba-ssm-cache-dtype")),
    Knob("TOOLS", _bit, _rules(Rule(1)), "tool calling (`--enable-auto-tool-choice`); 0 = off",
         argv=lambda value, v, z: ["--enable-auto-tool-choice", "--tool-call-parser", v.tool_parser] if value else []),
    Knob("TOOL_PARSER", _text, _rules(Rule("qwen3_coder")),
         "must read the XML calls this model's template emits; `hermes` reads JSON and fails silently"),
    Knob("VISION", _bit, _rules(Rule(0)),
         "1 keeps the vision tower (0.858 GiB) instead of `--language-model-only`; one image per prompt of at most "
         f"{VISION_IMAGE_TOKENS} image tokens (`max_pixels`), both overridable from EXTRA_ARGS",
         argv=_switch(["--limit-mm-per-prompt", json.dumps({"image": 1}),
                       "--mm-processor-kwargs", json.dumps({"max_pixels": VISION_MAX_PIXELS})],
                      ["--language-model-only"])),
    Knob("VISION_OFFLOAD", _bit, _rules(
        Rule(1, {"VISION": 1}, "the whole tower takes 0.858 GiB of the card; with SPEC=dflash2 24 GB do not boot (spec)"),
        Rule(0)),
         "VISION=1: the tower's weights in pinned host RAM, each module copied to the card for its own forward, at "
         "most VISION_OFFLOAD_GIB of it on the card at once (spec: 296 -> 333 ms per 8192-patch image, reference "
         "RTX 3090; H200: bit-exact, 37.9 -> 50.8 ms, bench/results/vision-offload-h200.json); 0 keeps the whole tower "
         "on the card",
         export=Export(VISION_OFFLOAD_ENV, {"VISION": 1})),
    Knob("VISION_OFFLOAD_GIB", _gib_at_least(VISION_OFFLOAD_MIN_GIB), _rules(Rule(VISION_OFFLOAD_GIB)),
         f"VISION_OFFLOAD=1: GiB of the tower on the card at once (at least {VISION_OFFLOAD_MIN_GIB}); modules that "
         "fit stay there, largest first, the rest stream through one slot; the memory model counts this instead of "
         "the tower", export=Export(f"{VISION_OFFLOAD_ENV}_GIB", {"VISION": 1, "VISION_OFFLOAD": 1})),
    Knob("REQ_METRICS", _bit, _rules(Rule(0)),
         "1 = `--enable-per-request-metrics --enable-force-include-usage` (not with --disable-log-stats)",
         argv=_switch(["--enable-per-request-metrics", "--enable-force-include-usage"])),
    Knob("API_SERVERS", _int(1, 64), _rules(Rule(1)), "--api-server-count: HTTP front-end processes",
         argv=_opt("--api-server-count", unless=1)),
    Knob("ASYNC_SCHED", _bit, _rules(
        # DFLASH_TOKENS>7: vLLM's AsyncScheduler schedules num_speculative_tokens placeholder drafts before a step's
        # drafts exist, so the block the long-block schedule picks per step would never reach it
        # (engine/spec_verify_block.py); the sync scheduler schedules the width the runner hands back
        Limit(0, {"SPEC": "dflash2"}, "the verify-block length feeds back to the scheduler on the sync path only",
              allowed=(0,),
              message="ASYNC_SCHED=1 with SPEC=dflash2: the verify-block length reaches the scheduler only "
                      "on the synchronous path; unset ASYNC_SCHED"),
        Rule(1)), "async scheduling", argv=_switch(["--async-scheduling"], ["--no-async-scheduling"])),
    Knob("CUDAGRAPH_MODE", _choice("auto", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE"),
         _rules(Limit("PIECEWISE", {"SPEC": "mtp", "CTX": "huge"},
                      "spec: under FULL one prompt length in 128 comes back corrupted on a prefix-cache hit",
                      allowed=("PIECEWISE", "NONE"), warn=True,
                      message="CUDAGRAPH_MODE={CUDAGRAPH_MODE} with SPEC=mtp CTX=huge is unsafe: under FULL "
                              "capture one prompt length in 128 comes back corrupted on a prefix-cache hit (spec)"),
                Rule("auto")), "CUDA-graph capture mode; `auto` leaves it to vLLM",
         argv=lambda value, v, z: [] if value == "auto" else ["--compilation-config",
                                                             json.dumps({"cudagraph_mode": value})]),
    Knob("GDN_PREFILL", _choice("auto", "triton", "flashinfer", "cutedsl"), _rules(Rule("auto")),
         "--gdn-prefill-backend; `triton` where FlashInfer is not installed (sm90 picks FlashInfer)",
         argv=_opt("--gdn-prefill-backend", unless="auto")),
    Knob("MODEL", _text, _rules(
        Rule("auto", {"mode": "single"}),
        Rule(BASE_MODEL)), f"checkpoint dir; single `auto` = `{FAST_MODEL}` if present, else `{BASE_MODEL}`",
        argv=lambda value, v, z: [z.model, "--served-model-name", SERVED_NAME]),  # z.model: `auto` resolved
    Knob("EXTRA_ARGS", _args, _rules(Rule("")),
         "appended to the vllm argv as is (e.g. `--seed 1`); the tensor-parallel size is TP, the key VLLM_API_KEY",
         argv=lambda value, v, z: shlex.split(value)),
)

# Cross-knob refusals and warnings not tied to one default (each Limit above is one too).
CHECKS: tuple[Check, ...] = (
    Check({"EXTRA_ARGS": HasArg("--api-key")},
          "EXTRA_ARGS carries --api-key, which every user of this machine can read in the process list; "
          f"set VLLM_API_KEY or write it to {API_KEY_FILE} instead"),
    Check({"EXTRA_ARGS": HasArg("--tensor-parallel-size", ("-tp",))},
          "EXTRA_ARGS carries --tensor-parallel-size, which the plan would not size the pool, the seats and the "
          "weights for; drop it and set TP=2 (or TP=4) instead"),
    Check({"REQ_METRICS": 1, "EXTRA_ARGS": HasArg("--disable-log-stats")},
          "REQ_METRICS=1 needs vLLM's stats logging, and EXTRA_ARGS has --disable-log-stats; drop one"),
    Check({"INT8_ACT": "int8", "INT8_LAYERS": Alternatives(frozenset({"mlp", "linear_attn"}))},
          "INT8_LAYERS={INT8_LAYERS} crashes inductor at the first forward on this pin; use "
          "INT8_LAYERS=mlp or INT8_LAYERS='mlp|linear_attn|self_attn'"),
    Check({"INT8_ACT": "off", "INT8_LAYERS": SET},
          "INT8_LAYERS is set but INT8_ACT=off; set INT8_ACT=int8 for it to apply", warn=True),
    Check({"TOOLS": 1, "TOOL_PARSER": "hermes"},
          "TOOL_PARSER=hermes reads JSON calls; this model's template emits XML (qwen3_coder)", warn=True),
    Check({"SPEC": "dflash2", "DRAFT_TOKENS": SET},
          "DRAFT_TOKENS is MTP's depth; with SPEC=dflash2 set DFLASH_TOKENS", warn=True),
    Check({"SPEC": "dflash2", "VISION": 1, "VISION_OFFLOAD": 0},
          "SPEC=dflash2 VISION=1 VISION_OFFLOAD=0 keeps the whole 0.858 GiB vision tower on the card, which beside "
          "the DFlash2 drafter does not boot on a 24 GB card (spec); unset VISION_OFFLOAD there", warn=True),
    Check({"VISION": 0, "VISION_OFFLOAD": 1},
          "VISION_OFFLOAD=1 streams the vision tower from host RAM, and VISION=0 serves without the tower; set "
          "VISION=1 for images, or unset VISION_OFFLOAD"),
    Check({"VISION_OFFLOAD": 0, "VISION_OFFLOAD_GIB": SET},
          "VISION_OFFLOAD_GIB is set but VISION_OFFLOAD=0 (or VISION=0); it applies with VISION=1 VISION_OFFLOAD=1",
          warn=True),
    Check({"mode": "single", "PREFILL_ATTN": "int8", "CTX": ("long", "huge")},
          "PREFILL_ATTN=int8 hooks vLLM's FlashAttention backend, and CTX={CTX} serves on another one: set "
          "PREFILL_ATTN=off, or CTX=fast for the int8 prefill"),
    Check({"mode": "single", "PREFILL_ATTN": "int8", "INT8_ACT": Not("int8")},
          "PREFILL_ATTN=int8 alone is noise-to-slightly-positive (spec); pair it with INT8_ACT=int8", warn=True),
)

# The order knobs render in: vLLM takes its flags in any order, this one keeps `--dry-run` output stable.
# BATCHED_TOKENS is the mode's own --max-num-batched-tokens (Sized.batched_tokens), not a knob.
BATCHED_TOKENS = "--max-num-batched-tokens"
RENDER_ORDER = ("MODEL", "HOST", "PORT", "TP", "MAX_SEQS", "MAX_LEN", "STATE_DTYPE", "CTX", "KV", "KV_MEM", "GPU_UTIL",
                "PREFIX_CACHE", "SPEC", "ASYNC_SCHED", "CUDAGRAPH_MODE", BATCHED_TOKENS, "TOOLS", "VISION",
                "VISION_OFFLOAD", "VISION_OFFLOAD_GIB",
                "REQ_METRICS", "API_SERVERS", "GDN_PREFILL", "EXTRA_ARGS",
                "INT8_ACT", "INT8_LAYERS", "SPEC_ATTN", "MTP_DRAFT_VOCAB", "PREFILL_ATTN", "LOOKUP",
                *(var for var, *_ in LOOKUP_PARAMS), LOOKUP_STICKY)

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


@dataclass(frozen=True)
class Values:
    """Every knob's resolved value, typed, one field per knob (its name in lower case). A knob the mode
    does not offer holds its idle value (SPEC=off in batch mode)."""

    mode: str
    explicit: frozenset[str]  # the knobs set in the environment
    host: str
    published_on: str
    port: int
    tp: int
    spec: str
    ctx: str
    kv: str
    dflash_tokens: int
    draft_tokens: int
    max_seqs: int
    dflash_max_len: int
    max_len: int
    kv_mem: int | str
    draft: str
    lookup: int
    vllm_dflash2_lookup_nmin: int
    vllm_dflash2_lookup_nmax: int
    vllm_dflash2_lookup_nstrong: int
    vllm_dflash2_lookup_agree: int
    vllm_dflash2_lookup_sticky: int
    draft_sample: str
    spec_attn: int
    mtp_draft_vocab: int
    draft_ids: str
    prefix_cache: int
    int8_act: str
    int8_layers: str
    prefill_attn: str
    gpu_util: float
    state_dtype: str
    tools: int
    tool_parser: str
    vision: int
    vision_offload: int
    vision_offload_gib: float
    req_metrics: int
    api_servers: int
    async_sched: int
    cudagraph_mode: str
    gdn_prefill: str
    model: str
    extra_args: str

    @classmethod
    def of(cls, mode: str, settings: Mapping[str, Setting]) -> Values:
        values = {k.name.lower(): settings[k.name].value if k.name in settings else k.idle_value() for k in KNOBS}
        explicit = frozenset(name for name, s in settings.items() if s.source == "env")
        return cls(mode=mode, explicit=explicit, **values)

    def by_name(self) -> dict[str, object]:
        return {k.name: getattr(self, k.name.lower()) for k in KNOBS}


def checks() -> tuple[Check, ...]:
    """Every cross-knob refusal and warning: each Limit's, then CHECKS."""
    limits = tuple(rule.check(k.name) for k in KNOBS for rule in k.defaults if isinstance(rule, Limit))
    return limits + CHECKS


def violations(v: Values) -> tuple[list[str], list[str]]:
    """(refusals, warnings) that the knob values alone call for, messages formatted."""
    values = {name: value for name, value in v.by_name().items() if v.mode in BY_NAME[name].modes}
    refusals: list[str] = []
    warnings: list[str] = []
    for check in checks():
        if check.applies(v.mode, values, v.explicit):
            (warnings if check.warn else refusals).append(check.message.format_map(values))
    if v.mode == "single" and v.spec == "dflash2" and v.lookup and v.vllm_dflash2_lookup_nmin > v.vllm_dflash2_lookup_nmax:
        refusals.append(f"{LOOKUP_ENV}_NMIN={v.vllm_dflash2_lookup_nmin} is above {LOOKUP_ENV}_NMAX="
                        f"{v.vllm_dflash2_lookup_nmax}; the lookup could never match: lower NMIN or raise NMAX")
    return refusals, warnings


def kv_layout(v: Values) -> tuple[str, str, str]:
    """(--kv-cache-dtype, --attention-backend or "", why) from KV (batch) or CTX and SPEC (single)."""
    if v.mode == "batch":
        return {"fp8": ("fp8", "", "KV=fp8"),
                "int4pth": ("int4_per_token_head", "TRITON_ATTN", "KV=int4pth: vLLM's per-token-head int4")}[v.kv]
    if v.ctx == "huge":  # over KVarN on attention fidelity (docs/long-context.md, "Which cache CTX=huge ships")
        return "int4_per_token_head", "TRITON_ATTN", "CTX=huge: vLLM's int4 per-token-head KV on Triton"
    if v.ctx == "long" and v.spec == "dflash2":
        return "int8_per_token_head", "TRITON_ATTN", "CTX=long with SPEC=dflash2: int8 per-token-head on Triton"
    if v.ctx == "long":
        return "fp8", "FLASHINFER", "CTX=long: fp8 KV, which needs FlashInfer on Ampere"
    return "auto", "FLASH_ATTN", "CTX=fast: bf16 KV on FlashAttention (the split-KV verify patch hooks it)"


def render(v: Values, z: Sized) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` argv and the exported variables, each knob rendering itself in RENDER_ORDER."""
    argv, env = ["vllm", "serve"], {}
    values = v.by_name()
    for name in RENDER_ORDER:
        if name == BATCHED_TOKENS:
            argv += [BATCHED_TOKENS, str(z.batched_tokens)] if z.batched_tokens is not None else []
            continue
        knob = BY_NAME[name]
        if v.mode not in knob.modes:
            continue
        if knob.argv:
            argv += knob.argv(values[name], v, z)
        if knob.export and all(holds(want, values[key]) for key, want in knob.export.when.items()):
            env[knob.export.var] = knob.export.text(values[name])
    return argv, env


def exported_vars() -> frozenset[str]:
    """Every variable a knob can export."""
    return frozenset(k.export.var for k in KNOBS if k.export)


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
    files.write_text_atomic(path, new)
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
