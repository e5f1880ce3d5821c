"""Plumbing for the GPU smoke tests (tests/gpu/test_smoke.py): server command lines and the servers
(bench.serving's server process, HTTP client and /metrics parsing under them), child processes, the near-tie
rule for greedy comparisons and the result JSON.

Standard library only, so it imports on any machine; tests/test_gpu_smoke_lib.py runs it on CPU with
fake data and checks the command lines against vLLM's own argument parsers.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # imported from a script run by hand, without the repo on PYTHONPATH
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402

RESULTS = Path(os.environ.get("QS_GPU_RESULTS", "/tmp/gpu-results"))  # what comes back from the device
WORK = Path(os.environ.get("QS_GPU_WORK", "/tmp/qs-gpu-work"))  # checkpoints and scratch, left there

# Environment every vLLM process gets on the device (tests/gpu/README.md explains each).
DEVICE_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not shipped: the sampler would fail to import it
    "HF_HUB_OFFLINE": "1",  # no network on the device: never wait for a hub timeout
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}

# Log line vLLM 0.28.0 prints once per W4A16 kernel class it picks
# (quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py, CompressedTensorsWNA16.create_weights).
WNA16_KERNEL_RE = re.compile(r"Using (\w+) for CompressedTensorsWNA16")
# Hybrid models: vLLM raises the attention block size to fit the GDN state page (platforms/interface.py).
BLOCK_SIZE_RE = re.compile(r"Setting attention block size to (\d+) tokens")


# ---------------------------------------------------------------------------------------------
# Server configurations


@dataclass(frozen=True)
class ServerSpec:
    """One `vllm serve` configuration, started once per test session."""

    key: str  # short id used in file names and the result JSON, e.g. "a-tiny-mtp"
    model_dir: Path
    served_name: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def log_name(self) -> str:
        return f"server-{self.key}.log"


def model_max_len(model_dir: Path, cap: int) -> int:
    """`cap`, or less when the checkpoint's config allows fewer positions (vLLM refuses a longer --max-model-len)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    derived = text_config.get("max_position_embeddings") or config.get("max_position_embeddings") or cap
    return min(cap, int(derived))


MTP_SPECULATION = {"method": "mtp", "num_speculative_tokens": 4}


# Flags shared by servers A and B (tiny checkpoint); B is A without speculation, so any greedy
# difference between them comes from MTP.
TINY_SERVER_FLAGS = (
    "--enable-prefix-caching",  # the 0.28.0 default for hybrid models (mamba cache mode `align`), made explicit
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen3_coder",
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens per request
    "--logprobs-mode",
    "raw_logits",  # logprobs carry raw logits: the near-tie rule needs the logit scale (bf16 ulp)
)

# Every server pins its KV pool (--kv-cache-memory-bytes): vLLM then skips its free-memory profiling,
# which would be wrong while three servers start on the same GPU at once.


def tiny_server_specs(tiny_dir: Path) -> dict[str, ServerSpec]:
    """Server A (MTP speculation, 4 tokens) and server B (none) on the tiny checkpoint."""
    common = dict(
        model_dir=Path(tiny_dir),
        served_name="tiny",
        max_model_len=model_max_len(tiny_dir, 4096),
        max_num_seqs=8,
        kv_cache_bytes=2 * GIB,
    )
    return {
        "a": ServerSpec(
            key="a-tiny-mtp",
            extra_args=(*TINY_SERVER_FLAGS, "--speculative-config", json.dumps(MTP_SPECULATION)),
            **common,
        ),
        "b": ServerSpec(key="b-tiny", extra_args=TINY_SERVER_FLAGS, **common),
    }


def shape_server_spec(shape_dir: Path) -> ServerSpec:
    """Server C: the shape checkpoint with Marlin forced (vLLM picks Machete on sm90; the RTX 3090 runs Marlin)."""
    return ServerSpec(
        key="c-shape-marlin",
        model_dir=Path(shape_dir),
        served_name="shape",
        max_model_len=model_max_len(shape_dir, 2048),
        max_num_seqs=4,
        kv_cache_bytes=4 * GIB,
        extra_env={"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"},
    )


def serve_argv(spec: ServerSpec, port: int, python: str = "python3") -> list[str]:
    """The `vllm serve` command line for `spec` (module form: the pinned stack has no console script on PATH)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(spec.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        spec.served_name,
        "--language-model-only",  # qwen3_5 is a VL wrapper; these checkpoints carry no vision tower
        "--gdn-prefill-backend",
        "triton",  # "auto" picks FlashInfer's GDN prefill on sm90, and flashinfer is not shipped
        "--enforce-eager",  # functional tests: skip torch.compile and CUDA graph capture
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--gpu-memory-utilization",
        "0.1",  # only vLLM's start-up free-memory check reads it once the KV pool is pinned
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--seed",
        "0",
        *spec.extra_args,
    ]


def server_env(spec: ServerSpec, base: Mapping[str, str]) -> dict[str, str]:
    return {**base, **DEVICE_ENV, **spec.extra_env}


def bench_serve_argv(
    base_url: str, served_name: str, tokenizer_dir: Path, result_dir: Path, result_name: str, python: str = "python3"
) -> list[str]:
    """A short `vllm bench serve` run whose saved result becomes a fixture for the bench harness."""
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        served_name,
        "--tokenizer",
        str(tokenizer_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "32",
        "--num-prompts",
        "16",
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]


class SmokeServer(serving.ServerProcess):
    """One ServerSpec's `vllm serve` on a free port, taken when the server is made (right before its launch:
    servers starting beside it take ports too)."""

    def __init__(self, spec: ServerSpec, log_path: Path, env: Mapping[str, str], python: str = "python3"):
        port = serving.free_port()
        super().__init__(spec.key, serve_argv(spec, port, python), port, log_path, server_env(spec, env))
        self.spec = spec


def trim_to_tail(path: Path, max_bytes: int) -> None:
    """Keep only the last `max_bytes` of a log (results must stay under the transfer limit)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size <= max_bytes:
        return
    with open(path, "rb") as handle:
        handle.seek(-max_bytes, os.SEEK_END)
        tail = handle.read()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"[... earlier output trimmed ...]\n" + tail)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Child processes (offline engines, synth)


def child_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus DEVICE_ENV, with the repo on PYTHONPATH: the patched vLLM's hooks import qwen_serving."""
    env = {**base, **DEVICE_ENV}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@dataclass
class ChildRun:
    rc: int | str  # exit code, or "timeout" when it was killed
    log: str  # everything it printed
    record: dict  # the JSON it wrote; {} when it wrote none


def run_json_children(
    children: Mapping[str, tuple[Sequence[str], Path, Path]], env: Mapping[str, str], timeout_s: float
) -> dict[str, ChildRun]:
    """Start every child at once (name: argv, the JSON file it writes, its log file) in the repo, then wait for
    all of them within one `timeout_s`, killing any still running then. A JSON file left from an earlier run is
    removed first, so a record always comes from this run."""
    procs = {}
    for name, (argv, out, log_path) in children.items():
        out.unlink(missing_ok=True)
        log = open(log_path, "w")  # closed once the child exits
        procs[name] = (subprocess.Popen(list(argv), cwd=REPO, env=dict(env), stdout=log, stderr=subprocess.STDOUT),
                       out, log)
    deadline = time.monotonic() + timeout_s
    runs = {}
    for name, (proc, out, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        record = json.loads(out.read_text()) if out.exists() else {}
        runs[name] = ChildRun(rc, Path(log.name).read_text(errors="replace"), record)
    return runs


# ---------------------------------------------------------------------------------------------
# Greedy comparison with the near-tie rule

# A divergence between two greedy runs is explained only by a near-tie, measured at the first
# diverging position: both engines rank the two tokens as their top two, and both logit gaps between
# them are within the noise we measured between the runs:
#   noise     = the largest |logit_A - logit_B| of the chosen token over all positions where both
#               runs saw the same context (e.g. bf16 differences between MTP verify and plain decode),
#   tolerance = min(ceiling, max(NOISE_FACTOR * noise, ULP_FACTOR * ulp)),
#   ceiling   = max(CEILING_NATS, CEILING_ULPS * ulp),  ulp = bf16 spacing at the top logit.
# The bf16 floor: logits leave a bf16 lm_head, so two logits one bf16 step apart can swap order from a
# single rounding difference even where the measured noise happened to be 0 (at a logit of 10 one
# step is 0.0625). The ceiling keeps a noisy engine from explaining away real differences.
NOISE_FACTOR = 2.0
ULP_FACTOR = 2.0
CEILING_NATS = 0.1
CEILING_ULPS = 4.0
# Raw logits requested per position: a random model's top logits crowd within a few bf16 steps, so two
# near-tied tokens are often not both in a top-2 list; 20 makes the gap measurable (H200 run, 2026-11-29).
TIE_TOP_K = 20


def near_tie_tolerance(noise: float, top_logit: float) -> float:
    ulp = bf16_ulp(top_logit)
    return min(max(CEILING_NATS, CEILING_ULPS * ulp), max(NOISE_FACTOR * noise, ULP_FACTOR * ulp))


def bf16_ulp(value: float) -> float:
    """Spacing of bfloat16 numbers (8 significant bits) at `value`."""
    if value == 0 or not math.isfinite(value):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


@dataclass
class GreedyTrace:
    """One prompt's greedy continuation: chosen token ids, their logit, and the top-k logits per position."""

    token_ids: list[int]
    chosen: list[float]
    top: list[dict[int, float]]

    @classmethod
    def from_record(cls, record: Mapping) -> GreedyTrace:
        """A trace read back from JSON, where each top-k is a {token: logit} object (JSON turns the int token
        ids into strings) or a [[token, logit], ...] list. Token ids come back as ints: a str key would never
        match the int token ids, and every divergence would read as "not a tie"."""
        top = [{int(t): float(v) for t, v in (entry.items() if isinstance(entry, Mapping) else entry)}
               for entry in record["top"]]
        trace = cls([int(t) for t in record["token_ids"]], [float(v) for v in record["chosen"]], top)
        if not len(trace.token_ids) == len(trace.chosen) == len(trace.top):
            raise ValueError("token_ids, chosen and top differ in length")
        return trace


def _token_id(key: str) -> int:
    # completions with return_tokens_as_token_ids=true name tokens "token_id:<id>"
    if not key.startswith("token_id:"):
        raise ValueError(f"logprob key {key!r} is not 'token_id:<id>' (request return_tokens_as_token_ids)")
    return int(key.split(":", 1)[1])


def trace_from_choice(choice: Mapping) -> GreedyTrace:
    """Read a /v1/completions choice made with return_token_ids, logprobs>=2, return_tokens_as_token_ids."""
    token_ids = list(choice["token_ids"])
    logprobs = choice["logprobs"]
    chosen = [float(v) for v in logprobs["token_logprobs"]]
    top = [{_token_id(k): float(v) for k, v in (entry or {}).items()} for entry in logprobs["top_logprobs"]]
    named = [_token_id(t) for t in logprobs["tokens"]]
    if named != token_ids or len(chosen) != len(token_ids) or len(top) != len(token_ids):
        raise ValueError("token_ids, tokens, token_logprobs and top_logprobs disagree in the response")
    return GreedyTrace(token_ids, chosen, top)


@dataclass
class Divergence:
    prompt: int
    position: int
    token_a: int
    token_b: int
    gap_a: float | None  # A's logit of token_a minus its logit of token_b (None: token_b not in A's top-k)
    gap_b: float | None  # B's logit of token_b minus its logit of token_a
    top_logit_b: float
    tolerance: float
    explained: bool
    reason: str


@dataclass
class GreedyComparison:
    identical_prompts: int
    compared_positions: int
    noise: float
    divergences: list[Divergence]

    @property
    def unexplained(self) -> list[Divergence]:
        return [d for d in self.divergences if not d.explained]

    def summary(self) -> dict:
        return {
            "prompts": self.identical_prompts + len(self.divergences),
            "token_identical_prompts": self.identical_prompts,
            "positions_compared": self.compared_positions,
            "measured_logit_noise": self.noise,
            "rule": (
                f"divergence explained iff both tokens are in each run's top-{TIE_TOP_K} raw logits and both logit gaps <= "
                f"min(max({CEILING_NATS}, {CEILING_ULPS}*ulp), max({NOISE_FACTOR}*noise, {ULP_FACTOR}*ulp)), "
                "ulp = bf16 spacing at the top logit"
            ),
            "divergences": [d.__dict__ for d in self.divergences],
        }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(runs_a: Sequence[GreedyTrace], runs_b: Sequence[GreedyTrace]) -> GreedyComparison:
    """Compare engine A's greedy traces with engine B's, prompt by prompt (see the near-tie rule above)."""
    if len(runs_a) != len(runs_b):
        raise ValueError(f"{len(runs_a)} traces from A but {len(runs_b)} from B")
    splits = [first_divergence(a.token_ids, b.token_ids) for a, b in zip(runs_a, runs_b, strict=True)]
    noise = 0.0
    compared = 0
    for a, b, split in zip(runs_a, runs_b, splits, strict=True):
        same = len(a.token_ids) if split is None else split
        for position in range(same):
            noise = max(noise, abs(a.chosen[position] - b.chosen[position]))
        compared += same
    divergences = []
    for prompt, (a, b, split) in enumerate(zip(runs_a, runs_b, splits, strict=True)):
        if split is None:
            continue
        if split >= min(len(a.token_ids), len(b.token_ids)):
            divergences.append(
                Divergence(prompt, split, -1, -1, None, None, 0.0, 0.0, False, "outputs differ in length")
            )
            continue
        divergences.append(_judge(prompt, split, a, b, noise))
    return GreedyComparison(splits.count(None), compared, noise, divergences)


def _judge(prompt: int, position: int, a: GreedyTrace, b: GreedyTrace, noise: float) -> Divergence:
    token_a, token_b = a.token_ids[position], b.token_ids[position]
    top_a, top_b = a.top[position], b.top[position]
    top_logit_b = b.chosen[position]
    tolerance = near_tie_tolerance(noise, top_logit_b)
    gap_a = top_a[token_a] - top_a[token_b] if token_a in top_a and token_b in top_a else None
    gap_b = top_b[token_b] - top_b[token_a] if token_a in top_b and token_b in top_b else None
    if gap_a is None or gap_b is None:
        reason = "the two tokens are not both in each engine's top-k: not a tie"
        explained = False
    elif max(gap_a, gap_b) <= tolerance:
        reason = f"near-tie: gaps {gap_a:.3g} (A) and {gap_b:.3g} (B) <= tolerance {tolerance:.3g}"
        explained = True
    else:
        reason = f"gap {max(gap_a, gap_b):.3g} exceeds tolerance {tolerance:.3g}: not a tie"
        explained = False
    return Divergence(prompt, position, token_a, token_b, gap_a, gap_b, top_logit_b, tolerance, explained, reason)


# ---------------------------------------------------------------------------------------------
# Result JSON


_OUTCOME_RANK = {"passed": 0, "unfinished": 1, "skipped": 2, "failed": 3}


def merge_outcome(previous: str | None, when: str, outcome: str) -> str:
    """Fold pytest's setup/call/teardown reports into one: failed beats skipped beats passed, and a test whose
    setup passed stays "unfinished" until its call passes (a run stopped mid-test leaves no call report)."""
    if outcome == "passed":
        outcome = {"setup": "unfinished", "call": "passed"}.get(when, previous or "passed")
        if when == "call" and previous == "unfinished":
            return outcome
    return max(previous or "passed", outcome, key=_OUTCOME_RANK.__getitem__)


def runner_phases(environ: Mapping[str, str]) -> dict[str, float]:
    """Phase timings measured by run_on_device.sh before pytest started (QS_GPU_RUNNER_PHASES, JSON)."""
    raw = environ.get("QS_GPU_RUNNER_PHASES", "")
    if not raw:
        return {}
    phases = json.loads(raw)
    if not isinstance(phases, dict):
        raise ValueError("QS_GPU_RUNNER_PHASES must be a JSON object")
    return {str(k): float(v) for k, v in phases.items()}


REPORTED_PACKAGES = ("vllm", "torch", "triton", "transformers", "compressed-tensors", "tokenizers")


def build_report(
    outcomes: Mapping[str, str],
    record: Mapping,
    exit_status: int,
    session_seconds: float,
    patches: Mapping,
    runner_t0: str | None = None,
) -> dict:
    """The content of gpu-smoke-h200.json."""
    import platform
    from datetime import UTC, datetime

    phases = {**record["phases_s"], "pytest_session": round(session_seconds, 1)}
    if runner_t0:
        phases["runner_total"] = round(time.time() - float(runner_t0), 1)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": gpu_description(),
        "host_cpu": host_cpu(),
        "versions": {"python": platform.python_version(), **package_versions(REPORTED_PACKAGES)},
        "patches": dict(patches),
        "pytest_exit_status": exit_status,
        "tests": dict(outcomes),
        "phases_s": phases,
        "measurements": record["measurements"],
    }


def gpu_description() -> dict[str, str]:
    """GPU name, driver and memory from nvidia-smi (no CUDA context needed)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return {"error": f"nvidia-smi failed: {err}"}
    first = out.strip().splitlines()[0] if out.strip() else ""
    parts = [p.strip() for p in first.split(",")]
    if len(parts) != 3:
        return {"raw": first}
    return {"name": parts[0], "driver": parts[1], "memory": parts[2]}


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The host's CPU model, logical CPUs and 1-minute load at the start: a host-bound step (a speculative one
    at C1) moves with them between machines."""
    try:
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]
    except OSError as err:
        return {"error": f"{cpuinfo}: {err}"}
    return {"model": models[0] if models else None, "logical_cpus": len(models) or os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2)}


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
