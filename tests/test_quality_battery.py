"""bench/quality_battery.py on the CPU: the GSM8K final-number rule, perplexity from prompt logprobs against a
fake vLLM whose distribution is known, resuming a stopped run, and the scripted check against the tiny scripted
checkpoint's reference forward (the battery's perplexity equals it; a wrong model, and one without the body where
the body counts, are caught)."""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import quality_battery as qb
from tests.helpers.fake_http import send_json

REPO = Path(__file__).resolve().parents[1]
MODEL = "qwen3.8-27b"


# ---------------------------------------------------------------- the final-number rule


@pytest.mark.parametrize("answer, expected", [
    ("#### 42", "42"),
    ("so she earns 9 * 2 = $18 a day.\n#### 18", "18"),  # the marker wins over later-looking numbers
    ("12 apples, then #### 7 and 9 more words", "7"),  # first number after the last marker
    ("The total is 1,234 dollars.", "1234"),  # thousands separators
    ("It costs $1,234.50 in all.", "1234.5"),  # $, commas, decimals
    ("The temperature falls to -7 degrees.", "-7"),  # negative
    ("He owes \u22125 dollars.", "-5"),  # a typographic minus
    ("#### $-5.", "-5"),
    ("The answer is 42.", "42"),  # a sentence's period is not a decimal point
    ("The answer is 3.0.", "3"),  # equal as decimals
    ("#### 0.50", "0.5"),
    ("Half of it: .5", "0.5"),
    ("First 3, then 5, and finally 12", "12"),  # several numbers: the last
    ("Between 1,000 and 2,500 people, about 1,750.", "1750"),
    ("\\boxed{1,000} is what I get, step 7 of 7", "1000"),  # a boxed answer beats the last number
    ("It grows by 50%.", "50"),
    ("- 5 apples", "5"),  # a list dash is not a minus sign
    ("tool v1.2 gives 10", "10"),
    ("I cannot tell.", None),  # none
    ("#### ", None),
    ("", None),
    ("-0", "0"),
])
def test_final_number_rule(answer, expected):
    assert qb.final_number(answer) == expected


def test_gsm8k_references_and_scoring():
    item = {"question": "q", "answer": "3 + 4 = <<3+4=7>>7 ...\n#### 1,600"}
    assert qb.score_gsm8k(item, "So the answer is $1600.")["correct"]
    assert qb.score_gsm8k(item, "1,600 or maybe 1,601")["correct"] is False
    assert qb.score_gsm8k(item, "no idea") == {"reference": "1600", "extracted": None, "correct": False,
                                                "answer": "no idea"}


def test_gsm8k_source_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(qb.BatteryError, match="--gsm8k-file .*missing"):
        qb.gsm8k_questions(tmp_path / "missing", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(qb.BatteryError, match="line 2"):
        qb.gsm8k_questions(bad, 2)
    with pytest.raises(qb.BatteryError, match="has 1 questions"):
        qb.gsm8k_questions(_gsm_file(tmp_path, 1), 5)
    # no network: the message names the way out; a download with the wrong content is refused
    with pytest.raises(qb.BatteryError, match="--gsm8k-file PATH"):
        qb.gsm8k_questions(None, 1, url="http://127.0.0.1:9/test.jsonl", timeout_s=5)
    good = _gsm_file(tmp_path, 3)
    with pytest.raises(qb.BatteryError, match="sha256"):
        qb.gsm8k_questions(None, 1, url=good.as_uri(), sha256="0" * 64)
    items, source = qb.gsm8k_questions(None, 2, url=good.as_uri(), sha256=source_sha(good))
    assert [i["question"] for i in items] == ["question 0", "question 1"] and source["questions_in_file"] == 3


def source_sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gsm_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"gsm-{n}.jsonl"
    path.write_text("".join(json.dumps({"question": f"question {i}", "answer": f"work\n#### {i * 1000:,}"}) + "\n"
                            for i in range(n)))
    return path


# ---------------------------------------------------------------- a fake vLLM


class FakeVllm(http.server.ThreadingHTTPServer):
    """The routes the battery reads, answered like vLLM 0.28.0: completions with `prompt_logprobs` (a list of
    {id: {logprob, rank, decoded_token}}, None first) from `logprobs_fn(ids) -> [T, V] log-probabilities` for
    token-id prompts, text prompts tokenized one byte per token and scored by bigram_logprobs; chat completions
    from `chat_fn(content)`."""

    def __init__(self, logprobs_fn: Callable, chat_fn: Callable[[str], str] = lambda q: "", fail_after: int | None = None):
        self.requests: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                routes = {"/version": {"version": "0.28.0"},
                          "/v1/models": {"data": [{"id": MODEL, "root": "/models/q", "max_model_len": 4096}]}}
                if self.path == "/metrics":
                    data = b"# no samples\n"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif self.path in routes:
                    send_json(self, routes[self.path])
                else:
                    send_json(self, {"detail": "Not Found"}, 404)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if fake_fails(fake, fail_after):
                    send_json(self, {"error": "engine dead"}, 500)
                elif self.path == "/v1/completions":
                    send_json(self, completion(body, logprobs_fn))
                elif self.path == "/v1/chat/completions":
                    text = chat_fn(body["messages"][-1]["content"])
                    send_json(self, {"choices": [{"message": {"content": text}, "finish_reason": "stop"}]})
                else:
                    send_json(self, {"detail": "Not Found"}, 404)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def fake_fails(fake: FakeVllm, fail_after: int | None) -> bool:
    return fail_after is not None and len(fake.requests) > fail_after


def completion(body: dict, logprobs_fn: Callable) -> dict:
    prompt = body["prompt"]
    ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
    table = bigram_logprobs(ids) if isinstance(prompt, str) else logprobs_fn(ids)
    plp: list = [None]
    for pos in range(1, len(ids)):
        row = [float(x) for x in table[pos - 1]]
        order = sorted(range(len(row)), key=lambda j: -row[j])
        keep = {ids[pos], *order[: body["prompt_logprobs"]]}
        plp.append({str(j): {"logprob": row[j], "rank": order.index(j) + 1, "decoded_token": "?"} for j in keep})
    return {"choices": [{"text": "x", "prompt_logprobs": plp, "prompt_token_ids": ids}],
            "usage": {"prompt_tokens": len(ids)}}


def bigram_logprobs(ids: list[int]) -> list[list[float]]:
    """A known byte-level model: p(next | prev) proportional to 1 + ((prev * 7 + next) % 13)."""
    rows = []
    for prev in ids:
        weights = [1.0 + ((prev * 7 + nxt) % 13) for nxt in range(256)]
        total = sum(weights)
        rows.append([math.log(w / total) for w in weights])
    return rows


def expected_text_ppl(text: str) -> tuple[int, float]:
    ids = list(text.encode())
    rows = bigram_logprobs(ids)
    nll = -sum(rows[i][ids[i + 1]] for i in range(len(ids) - 1))
    return len(ids) - 1, nll


def _run(args: list[str]) -> int:
    return qb.main(args)


def test_perplexity_and_gsm8k_against_a_fake_server(tmp_path, capsys):
    answers = {f"question {i}": f"Working...\n#### {i * 1000:,}" if i % 2 == 0 else "I think it is 5."
               for i in range(6)}
    server = FakeVllm(bigram_logprobs, lambda content: answers[content.rsplit("\n\n", 1)[1]])
    gsm = _gsm_file(tmp_path, 8)
    rc = _run(["t", "--url", server.url, "--out", str(tmp_path), "--gsm8k-file", str(gsm), "--gsm8k-n", "6",
               "--concurrency", "2"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "t-quality.json").read_text())
    total_tokens = total_nll = 0
    for name, file in qb.TEXT_FILES.items():
        tokens, nll = expected_text_ppl((qb.TEXTS / file).read_text())
        assert data["perplexity"]["texts"][name]["tokens"] == tokens  # every position but the first
        assert data["perplexity"]["texts"][name]["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-9)
        total_tokens, total_nll = total_tokens + tokens, total_nll + nll
    assert data["perplexity"]["pooled"]["ppl"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-9)
    # question 0 -> "#### 0" right, odd ones wrong ("5" vs 1000 i), 2 and 4 right: 3 of 6
    assert data["gsm8k"]["correct"] == 3 and data["gsm8k"]["accuracy"] == 0.5
    assert data["server"]["vllm_version"] == "0.28.0" and data["identity"]["model"] == MODEL
    assert data["gsm8k_source"]["sha256"] == source_sha(gsm)
    assert data["date"] == data["started"][:10] and data["finished"]
    chat = [r for r in server.requests if "messages" in r]
    assert all(r["temperature"] == 0 and r["chat_template_kwargs"] == {"enable_thinking": False} for r in chat)
    out = capsys.readouterr().out
    assert "GSM8K exact match: 3/6 = 50.0%" in out and "| **pooled** |" in out
    server.shutdown()


def test_a_stopped_run_continues_where_it_stopped(tmp_path, capsys):
    gsm = _gsm_file(tmp_path, 4)
    args = ["t", "--url", "", "--out", str(tmp_path), "--gsm8k-file", str(gsm), "--gsm8k-n", "4",
            "--concurrency", "1"]
    dying = FakeVllm(bigram_logprobs, lambda c: "#### 0", fail_after=4)  # 3 texts, one question, then HTTP 500
    args[2] = dying.url
    assert _run(args) == 3
    dying.shutdown()
    partial = json.loads((tmp_path / "t-quality.json").read_text())
    assert len(partial["perplexity"]["texts"]) == 3 and list(partial["gsm8k"]["items"]) == ["0"]
    assert "finished" not in partial
    healthy = FakeVllm(bigram_logprobs, lambda c: "#### 0")
    args[2] = healthy.url
    assert _run(args) == 0, capsys.readouterr().err
    asked = [r["messages"][-1]["content"].rsplit("\n\n", 1)[1] for r in healthy.requests if "messages" in r]
    assert sorted(asked) == ["question 1", "question 2", "question 3"]  # nothing asked twice, no text rescored
    assert not [r for r in healthy.requests if "prompt" in r]
    done = json.loads((tmp_path / "t-quality.json").read_text())
    assert done["gsm8k"]["answered"] == 4 and done["gsm8k"]["correct"] == 1  # only "#### 0" is right
    # another run's settings never mix into this file
    assert _run([*args[:-2], "--gsm8k-n", "3"]) == 2
    assert "holds another run" in capsys.readouterr().err
    healthy.shutdown()


def test_bad_arguments_and_no_server(tmp_path, capsys):
    with pytest.raises(SystemExit):
        qb.main(["t", "--parts", "perplexity,ifbench"])
    with pytest.raises(SystemExit):
        qb.main(["t", "--parts", "scripted"])
    with pytest.raises(SystemExit):
        qb.main(["t", "--expect-scripted", str(tmp_path)])
    capsys.readouterr()
    assert qb.main(["t", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "r")]) == 3
    assert "no usable vLLM server" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- the scripted check


@pytest.fixture(scope="module")
def scripted_tiny(tmp_path_factory) -> Path:
    from qwen_serving.checkpoint import synth

    out = tmp_path_factory.mktemp("scripted") / "tiny"
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted"]) == 0
    return out


def reference_server(model_dir: Path, scale: float = 1.0, blind_below: int = 0) -> FakeVllm:
    """The tiny scripted checkpoint's full float32 forward (residual branches, state and all), its logits rounded
    to bf16 as the engine returns them, then log-softmax in float32 (vLLM's compute_logprobs). Prompts shorter than
    `blind_below` ids get flat logits (visit 16's 5-token walk: gotcha 30)."""
    import torch

    from qwen_serving.checkpoint.scripted_reference import Reference

    ref = Reference(model_dir)

    def logprobs(ids: list[int]):
        with torch.no_grad():
            logits = ref.logits(ids).to(torch.bfloat16).float() * scale
        if len(ids) < blind_below:
            logits = torch.zeros_like(logits)
        return logits.log_softmax(-1).tolist()

    return FakeVllm(logprobs)


def table_server(model_dir: Path) -> FakeVllm:
    """A server whose logprobs are the context-free table's: every row lm_head(norm(embed(t))) of the position's
    own token, the body left out (what the check judged against before visit 16)."""
    import torch

    from qwen_serving.checkpoint.scripted_reference import Reference

    ref = Reference(model_dir)

    def logprobs(ids: list[int]):
        with torch.no_grad():
            return ref.context_free_logits(ids).log_softmax(-1).tolist()

    return FakeVllm(logprobs)


def loud_body(model_dir: Path, out: Path, factor: float = 4.0) -> Path:
    """A copy of the checkpoint whose residual branches write `factor` times more into the stream (the group scales
    of every o_proj, out_proj and down_proj times a power of two: exact in fp16 and bf16). The embeddings, norms
    and lm_head, so the context-free table and the walks sampled from it, stay as they were."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    branches = ("o_proj.weight_scale", "out_proj.weight_scale", "down_proj.weight_scale")
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(shard)
        scaled = {k: v * factor for k, v in tensors.items() if k.startswith("model.language_model.layers.")
                  and k.endswith(branches)}
        if scaled:
            save_file({**tensors, **scaled}, shard, metadata=metadata)
    return out


def test_the_judged_closed_form_is_the_reference_forward(scripted_tiny):
    """forward_logprobs batches walks of two lengths (the shorter padded at its end) and goes through the lm_head
    in row blocks: each walk's values are still its own Reference.logits, log-softmaxed, at its tokens."""
    import torch

    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.checkpoint.scripted_reference import Reference

    torch.set_num_threads(1)
    ref = Reference(scripted_tiny)
    walks = qb.scripted_walks(qb.ContextFreeTable(ref, Design.read(scripted_tiny).active), 240, 101)
    assert [len(w) for w in walks] == [101, 101, 41]
    logprobs, tops = qb.forward_logprobs(ref, walks)
    for walk, lp, top in zip(walks, logprobs, tops, strict=True):
        rows = ref.logits(walk)[:-1].double().log_softmax(-1)
        expected = rows[torch.arange(len(walk) - 1), torch.tensor(walk[1:])]
        assert torch.tensor(lp, dtype=torch.float64) == pytest.approx(expected, abs=1e-5)
        assert top == rows.argmax(-1).tolist()


def test_scripted_battery_matches_the_closed_form(scripted_tiny, tmp_path, capsys):
    import torch

    torch.set_num_threads(1)
    args = ["s", "--out", str(tmp_path), "--expect-scripted", str(scripted_tiny), "--scripted-tokens", "300",
            "--scripted-walk", "101"]
    server = reference_server(scripted_tiny)
    assert _run([*args, "--url", server.url]) == 0, capsys.readouterr().err
    server.shutdown()
    data = json.loads((tmp_path / "s-quality.json").read_text())
    check, design = data["scripted"]["check"], data["scripted"]["design_check"]
    assert check["tokens"] == 300 and [len(w["ids"]) for w in data["scripted"]["walks"]] == [101, 101, 101]
    assert check["within_tolerance"] and abs(check["relative_difference"]) < 1e-3
    assert check["logprob_diff_rms"] < 0.01  # against the forward, only the bf16 rounding of the logits is left
    assert check["top1_agreement"] == 1.0 and "judged" in check["closed_form"]
    # the design check is recorded beside it, not judged: the branches' wobble shows against the table
    assert "tolerance" not in design and "not judged" in design["closed_form"]
    assert 0.02 < design["logprob_diff_rms"] < 0.1 and design["top1_agreement"] == 1.0
    assert data["scripted"]["forward_s"] >= 0 and all(len(w["forward"]) == 100 for w in data["scripted"]["walks"])
    assert data["scripted"]["forward_peak_gib"] is None  # the forward ran on the CPU
    assert len(check["per_walk"]) == 3 and max(map(abs, check["per_walk"])) < 2e-3
    out = capsys.readouterr().out
    assert "reference forward (judged)" in out and "not judged: context-free table" in out
    # walks follow the design: mostly chain successors, each token scored against its own row
    design_file = json.loads((scripted_tiny / "scripted.json").read_text())
    chain = dict(zip(design_file["active"], design_file["chain"], strict=True))
    ids = [w["ids"] for w in data["scripted"]["walks"]]
    share = sum(chain[a] == b for w in ids for a, b in zip(w, w[1:], strict=False)) / 300
    assert 0.65 < share < 0.85  # designed: 0.755 at temperature 1
    assert 1.8 < check["closed_form_ppl"] < 2.4  # exp(entropy) of the designed rows, ~2.1

    # a model that is not the checkpoint (logits 8% sharper) is caught: exit 1, outside the tolerance
    wrong = reference_server(scripted_tiny, scale=1.08)
    assert _run(["w", *args[1:], "--url", wrong.url]) == 1
    wrong.shutdown()
    bad = json.loads((tmp_path / "w-quality.json").read_text())["scripted"]["check"]
    # (any other distribution scores the walks worse: sampled from the model, their cross-entropy is least under it)
    assert not bad["within_tolerance"] and bad["relative_difference"] > 0.005 and "OUTSIDE" in capsys.readouterr().out

    # a server wrong on one short walk only fails the whole check, and the per-walk figures name that walk
    blind = reference_server(scripted_tiny, blind_below=6)
    assert _run(["b", *args[1:5], "--scripted-tokens", "304", "--scripted-walk", "101", "--url", blind.url]) == 1
    blind.shutdown()
    per_walk = json.loads((tmp_path / "b-quality.json").read_text())["scripted"]["check"]["per_walk"]
    assert max(map(abs, per_walk[:3])) < 2e-3 and per_walk[3] > 10


def test_a_server_without_the_body_fails_where_the_body_counts(scripted_tiny, tmp_path, capsys):
    """A server that answers with the context-free table (no residual branches) agrees with the design check to
    float32 rounding. On the tiny checkpoint its per-token values are off the forward by the branches' wobble
    (rms ~0.05) but its perplexity over 300 tokens is not (-0.01%): the judged check passes it. With the branches
    four times louder (the same table and walks) it is 1.7% off the forward and fails."""
    import torch

    torch.set_num_threads(1)
    args = ["--out", str(tmp_path), "--scripted-tokens", "300", "--scripted-walk", "101"]
    loud = loud_body(scripted_tiny, tmp_path / "loud")
    for tag, ckpt, rc in (("quiet", scripted_tiny, 0), ("loud", loud, 1)):
        server = table_server(ckpt)
        assert _run([tag, *args, "--expect-scripted", str(ckpt), "--url", server.url]) == rc, capsys.readouterr().err
        server.shutdown()
    quiet, noisy = (json.loads((tmp_path / f"{tag}-quality.json").read_text())["scripted"] for tag in ("quiet", "loud"))
    assert [w["ids"] for w in quiet["walks"]] == [w["ids"] for w in noisy["walks"]]  # one table, one set of walks
    for section in (quiet, noisy):
        assert section["design_check"]["logprob_diff_rms"] < 1e-4 and section["design_check"]["top1_agreement"] == 1
    assert 0.03 < quiet["check"]["logprob_diff_rms"] < 0.1 and abs(quiet["check"]["relative_difference"]) < 1e-3
    assert noisy["check"]["logprob_diff_rms"] > 0.15 and noisy["check"]["relative_difference"] < -0.01
    assert not noisy["check"]["within_tolerance"]
    # and the engine that runs the loud body's forward passes there
    server = reference_server(loud)
    assert _run(["loud-forward", *args, "--expect-scripted", str(loud), "--url", server.url]) == 0
    server.shutdown()
    forward = json.loads((tmp_path / "loud-forward-quality.json").read_text())["scripted"]
    assert forward["check"]["within_tolerance"] and forward["design_check"]["relative_difference"] > 0.01


def test_gpu_script_on_the_cpu(scripted_tiny, tmp_path, capsys):
    """bench/gpu/quality_scripted.py, the H200 command, run here with --device cpu on the tiny checkpoint."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_scripted", REPO / "bench" / "gpu" / "quality_scripted.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    server = reference_server(scripted_tiny)
    out = tmp_path / "results" / "scripted-quality.json"
    argv = ["--url", server.url, "--ckpt", str(scripted_tiny), "--out", str(out), "--device", "cpu", "--tokens", "120"]
    assert gpu.main(argv) == 0, capsys.readouterr().err
    server.shutdown()
    data = json.loads(out.read_text())
    assert data["check_passed"] and data["elapsed_s"] > 0 and data["scripted"]["check"]["tokens"] == 120
    assert data["scripted"]["design_check"]["tokens"] == 120
    assert set(data["perplexity"]["texts"]) == set(qb.TEXT_FILES)


def test_scripted_battery_on_the_prepared_copy_reads_its_closed_form_from_the_int8_tensors(scripted_tiny, tmp_path,
                                                                                            capsys):
    """The product visit runs the check against the single-user plan, which serves the prepared copy: the forward
    (and the table) then read its int8 lm_head and embed_tokens, dequantized as vLLM holds them."""
    import shutil

    import torch

    from tests.helpers.tiny_checkpoint import run as prepare_step

    torch.set_num_threads(1)
    prepared = tmp_path / "prepared"
    shutil.copytree(scripted_tiny, prepared)
    assert prepare_step(prepared, "quant_lm_head") == 0 and prepare_step(prepared, "quant_embed") == 0
    assert not list(prepared.glob("*.safetensors")) == list(scripted_tiny.glob("*.safetensors"))
    args = ["--out", str(tmp_path), "--scripted-tokens", "200", "--scripted-walk", "101"]
    server = reference_server(prepared)
    assert _run(["p", *args, "--expect-scripted", str(prepared), "--url", server.url]) == 0, capsys.readouterr().err
    # the raw checkpoint's forward is another model's: the int8 rounding moves it
    assert _run(["r", *args, "--expect-scripted", str(scripted_tiny), "--url", server.url]) in (0, 1)
    server.shutdown()
    ours = json.loads((tmp_path / "p-quality.json").read_text())["scripted"]["check"]
    raw = json.loads((tmp_path / "r-quality.json").read_text())["scripted"]["check"]
    assert ours["within_tolerance"] and ours["logprob_diff_rms"] < raw["logprob_diff_rms"]


def test_the_reference_forward_alone_times_its_phases_and_sets_it_against_the_table(scripted_tiny, tmp_path):
    """bench/gpu/reference_forward.py (the check's forward without a server, to time it at full size on the GPU):
    the battery's walks, the forward's values as forward_logprobs gives them, the table's closed form beside them."""
    import importlib.util

    import torch

    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.checkpoint.scripted_reference import Reference

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("reference_forward", REPO / "bench/gpu/reference_forward.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "forward.json"
    assert tool.main(["--ckpt", str(scripted_tiny), "--out", str(out), "--device", "cpu", "--tokens", "300",
                      "--walk", "128"]) == 0
    data = json.loads(out.read_text())
    assert data["walks"] == [128, 128, 47] and data["peak_gib"] is None
    assert set(data["phases_s"]) == {"reference", "table", "walks", "forward"}  # the checkpoint was there
    ref = Reference(scripted_tiny)
    table = qb.ContextFreeTable(ref, Design.read(scripted_tiny).active)
    walks = qb.scripted_walks(table, 300, 128)
    forward, top = qb.forward_logprobs(ref, walks)
    expected = qb.compare([lp for w in forward for lp in w], [lp for w in walks for lp in table.closed_form(w)],
                          [t for w in top for t in w], [table.argmax(t) for w in walks for t in w[:-1]])
    assert data["forward_vs_table"] == pytest.approx(expected)
    assert len(data["per_walk_vs_table"]) == 3 and data["per_walk_vs_table"] != [0.0] * 3
