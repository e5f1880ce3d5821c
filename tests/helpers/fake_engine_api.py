"""vLLM 0.28.0's own OpenAI/Anthropic API server over a fake engine, on the CPU, in this process.

The app is the one `vllm serve` runs: `build_app` and `init_app_state` of vllm/entrypoints/openai/api_server.py
with a namespace from vLLM's own serve parser, so the routes, the middleware (the API key check), the exception
handlers, the request models, the serving classes (chat, completion, Anthropic messages), the chat template, the
tokenizer and the renderer are vLLM's. Only the engine is fake: `FakeEngine` implements vllm.engine.protocol's
EngineClient as AsyncLLM does in the API server process up to the engine core: `generate` runs the real
InputProcessor (the prompt-length, sampling and structured-output checks AsyncLLM runs before it hands a request
to the engine core), compiles a constrained request's grammar with vLLM's StructuredOutputManager as the engine
core would (a failure finishes that request with finish_reason "error", as the scheduler does), then yields canned
RequestOutputs one token at a time instead of the engine core's, and handles a closed or cancelled generator, a
client error and any other error as AsyncLLM.generate does (abort, re-raise, EngineGenerateError). Every abort,
failure and grammar error is recorded. app.state.server is a stand-in for uvicorn's server, whose should_exit
vLLM's handlers set when the engine is dead.

`AsgiClient` sends a request straight to the ASGI app as uvicorn would (ASGI spec 2.3, so a StreamingResponse
listens for the disconnect), records any exception that comes out of the app, and can leave early: after N body
chunks of a stream (a client that disconnects mid-stream) or after some seconds (before a non-streamed answer).
Two packages a GPU install has and the CPU venv lacks are stood in for (`_stand_ins`). CPU harness, fake engine:
nothing here has run against a served GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import types
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.engine.protocol import EngineClient
from vllm.exceptions import VLLMClientError
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers import renderer_from_config
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.engine.input_processor import InputProcessor

from tests.helpers.vllm_cli import VllmCli

TASKS = ("generate",)
TOKEN_DELAY_S = 0.005  # between canned tokens: a stream takes a few event-loop turns, as a real one does
CANNED_TEXT = "The harbour is calm and the ferry leaves at noon from the north bridge."


class FakeEngine(EngineClient):
    """AsyncLLM's side of the API server, with canned tokens where the engine core's would come."""

    def __init__(self, vllm_config, token_delay_s: float = TOKEN_DELAY_S):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.token_delay_s = token_delay_s
        self.canned_ids = self.renderer.get_tokenizer().encode(CANNED_TEXT, add_special_tokens=False)
        self.started: list[str] = []  # request ids that passed the InputProcessor
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.failed: list[tuple[str, str]] = []  # (request id, the error AsyncLLM would wrap in EngineGenerateError)
        self.grammar_errors: list[tuple[str, str]] = []  # (request id, why the engine core's compile failed)
        self.params: dict[str, SamplingParams] = {}  # what each admitted request asked the engine core for
        self.prompt_lengths: dict[str, int] = {}
        self._grammars = None

    # -- what the API layer calls

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, prompt_text=None,
                       lora_request=None, tokenization_kwargs=None, trace_headers=None, priority=0,
                       data_parallel_rank=None, session_id=None, reasoning_ended=None,
                       reasoning_parser_kwargs=None) -> AsyncGenerator[RequestOutput, None]:
        admitted = False
        try:
            process = (self.input_processor.process_inputs if isinstance(prompt, dict) and "type" in prompt
                       else self.input_processor.process_inputs_async)
            request = process(request_id, prompt, sampling_params, supported_tasks=TASKS,
                              lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                              trace_headers=trace_headers, priority=priority, data_parallel_rank=data_parallel_rank,
                              session_id=session_id)
            if asyncio.iscoroutine(request):
                request = await request
            admitted = True
            self.started.append(request_id)
            self.params[request_id] = request.params
            self.prompt_lengths[request_id] = len(request.prompt_token_ids or [])
            text = prompt_text if prompt_text is not None else extract_prompt_components(self.model_config, prompt)[0]
            grammar_error = self._compile_grammar(request)
            if grammar_error:
                yield self._finished_with_error(request_id, request.prompt_token_ids or [], request.params.n)
            else:
                async for out in self._outputs(request_id, text, request.prompt_token_ids or [], request.params):
                    yield out
            self.finished.append(request_id)
        except (asyncio.CancelledError, GeneratorExit):
            if admitted:
                await self.abort(request_id)
            raise
        except (EngineDeadError, VLLMClientError):
            raise
        except Exception as err:  # AsyncLLM.generate: an unexpected error aborts and becomes EngineGenerateError
            self.failed.append((request_id, f"{type(err).__name__}: {err}"))
            if admitted:
                await self.abort(request_id)
            raise EngineGenerateError() from err

    def _compile_grammar(self, request) -> str:
        """The engine core's first step for a constrained request, run here with vLLM's own
        StructuredOutputManager (its scheduler waits for the compile): '' when it compiles, else the error,
        which finishes only this request, as FINISHED_ERROR (finish_reason "error")."""
        if request.sampling_params is None or request.sampling_params.structured_outputs is None:
            return ""
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        if self._grammars is None:
            self._grammars = StructuredOutputManager(self.vllm_config)
            self._grammars._use_async_grammar_compilation = False  # compiled in this call, not in a thread
        core_request = Request.from_engine_core_request(request, block_hasher=None)
        self._grammars.grammar_init(core_request)
        error = core_request.structured_output_request.grammar  # the compiled grammar, or the compile's exception
        if not isinstance(error, Exception):
            return ""
        self.grammar_errors.append((request.request_id, f"{type(error).__name__}: {error}"))
        return self.grammar_errors[-1][1]

    @staticmethod
    def _finished_with_error(request_id: str, prompt_ids: list[int], n: int) -> RequestOutput:
        outputs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                    finish_reason="error") for i in range(n)]
        return RequestOutput(request_id, None, prompt_ids, None, outputs, finished=True)

    async def _outputs(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams):
        length = max(1, min(params.max_tokens or len(self.canned_ids), len(self.canned_ids)))
        ids = self.canned_ids[:length]
        tokenizer = self.renderer.get_tokenizer()
        delta = params.output_kind == RequestOutputKind.DELTA
        # as the engine core: no logprob for the first prompt token, then one row per token, in the first output
        prompt_logprobs = None if params.prompt_logprobs is None else [
            None, *self._logprobs(prompt_ids[1:], params.prompt_logprobs)]
        for step in range(1, length + 1):
            await asyncio.sleep(self.token_delay_s)
            final = step == length
            if params.output_kind == RequestOutputKind.FINAL_ONLY and not final:
                continue
            first = step - 1 if delta else 0
            window = ids[first:step]
            outputs = [CompletionOutput(
                index=i, text=tokenizer.decode(window), token_ids=list(window), cumulative_logprob=-0.1 * step,
                logprobs=self._logprobs(window, params.logprobs), finish_reason="length" if final else None)
                for i in range(params.n)]
            first_out = step == 1 or not delta
            yield RequestOutput(request_id, prompt_text, prompt_ids, prompt_logprobs if first_out else None, outputs,
                                finished=final)

    def _logprobs(self, window: list[int], top: int | None):
        if top is None:
            return None
        tokenizer = self.renderer.get_tokenizer()
        rows = []
        for token in window:
            row = {token: Logprob(-0.1, rank=1, decoded_token=tokenizer.decode([token]))}
            for rank, other in enumerate(range(1000, 1000 + max(0, top)), start=2):
                row.setdefault(other, Logprob(-1.0 - rank, rank=rank, decoded_token=tokenizer.decode([other])))
            rows.append(row)
        return rows

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        self.aborted.extend([request_id] if isinstance(request_id, str) else request_id)

    # -- the rest of the protocol: an engine that is up and idle

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    def encode(self, *args, **kwargs):
        raise NotImplementedError("the fake engine generates only")

    async def notify_kv_transfer_request_rejected(self, *args, **kwargs) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def start_profile(self) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return True

    async def sleep(self, level: int = 1, mode="abort") -> None:
        return None

    async def wake_up(self, tags=None) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request) -> bool:
        return False

    async def pause_generation(self, **kwargs) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        return None

    async def get_supported_tasks(self):
        return TASKS


@dataclass
class Response:
    status: int  # 0: nothing was sent
    headers: dict[str, str]
    chunks: list[bytes] = field(default_factory=list)
    raised: str = ""  # an exception that came out of the app

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()

    def json(self):
        return json.loads(self.text)

    def events(self) -> list[str]:
        """The data lines of an event stream."""
        return [line[len("data: "):] for line in self.text.splitlines() if line.startswith("data: ")]


class AsgiClient:
    """Requests to the ASGI app, as uvicorn hands them over, on one event loop the app's state was built on."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop, key: str | None = None):
        self.app, self.loop, self.key = app, loop, key
        self.raised: list[str] = []  # every exception that came out of the app, for any request

    def post(self, path: str, body: object = None, *, raw: bytes | None = None, key: str | None = "default",
             headers: dict[str, str] | None = None, drop_after_chunks: int | None = None,
             leave_after_s: float | None = None) -> Response:
        """POST JSON (or `raw` bytes as they are); `key` "default" sends the client's key as a bearer token, None
        sends none. The client disconnects once it has read `drop_after_chunks` body chunks, or `leave_after_s`
        seconds after it sent the request (status 0: it left before the answer started)."""
        data = raw if raw is not None else json.dumps(body).encode()
        sent = {"content-type": "application/json", **(headers or {})}
        key = self.key if key == "default" else key
        if key is not None:
            sent["authorization"] = f"Bearer {key}"
        return self.loop.run_until_complete(self._call("POST", path, data, sent, drop_after_chunks, leave_after_s))

    async def _call(self, method, path, data, headers, drop_after_chunks, leave_after_s) -> Response:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        response = Response(0, {})
        gone = asyncio.Event()
        body_sent = False
        if leave_after_s is not None:
            asyncio.get_running_loop().call_later(leave_after_s, gone.set)

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():
                return  # uvicorn drops what is sent after the client left
            if message["type"] == "http.response.start":
                response.status = message["status"]
                response.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    response.chunks.append(message["body"])
                if drop_after_chunks is not None and len(response.chunks) >= drop_after_chunks:
                    gone.set()
                if not message.get("more_body", False):
                    gone.set()  # the response is over: what the app still listens for is the connection's end

        try:
            await self.app(scope, receive, send)
        except Exception as err:  # uvicorn logs it; what the client got is what was sent before (a 500, if anything)
            response.raised = f"{type(err).__name__}: {err}"
            self.raised.append(f"{method} {path}: {response.raised}")
        return response


@dataclass
class Server:
    app: object
    engine: FakeEngine
    client: AsgiClient
    model: str
    max_model_len: int
    loop: asyncio.AbstractEventLoop

    def settle(self, seconds: float = 0.05) -> None:
        """Let the app's leftover tasks (an abort after a disconnect) run."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    @contextlib.contextmanager
    def slow_tokens(self, delay_s: float = 0.02):
        """Canned tokens this far apart, so that a client can leave before the answer ends."""
        self.engine.token_delay_s = delay_s
        try:
            yield
        finally:
            self.engine.token_delay_s = TOKEN_DELAY_S


class _Absent:
    """What a stand-in module gives for any name: a type to annotate with, an error when it is used."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("a stand-in for a package the CPU venv lacks was called (tests/helpers/fake_engine_api.py)")


def _absent_attribute(name: str):
    if name.startswith("__"):  # module protocol (inspect, pickle) asks for these: the stand-in has none
        raise AttributeError(name)
    return _Absent


def _stand_in(name: str, **attrs) -> types.ModuleType | None:
    """Put a module the CPU venv lacks into sys.modules (None, and nothing done, where the package is installed)."""
    package = name.split(".")[0]
    loaded = sys.modules.get(package)
    if (loaded.__spec__ is not None) if loaded is not None else importlib.util.find_spec(package) is not None:
        return None
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__getattr__ = _absent_attribute
    sys.modules[name] = module
    return module


class _NoInstrumentation:
    def __init__(self, *args, **kwargs):
        pass

    def add(self, *args, **kwargs):
        return self

    def instrument(self, app, *args, **kwargs):
        return self

    def expose(self, app, *args, **kwargs):
        return self


def _stand_ins() -> None:
    """Packages a GPU install of vLLM 0.28.0 has and the CPU venv lacks, where vLLM touches them at import or at
    build_app. prometheus-fastapi-instrumentator: /metrics; its middleware counts requests and re-raises what the
    app raises, so instrumenting nothing leaves every answer as it is. lm-format-enforcer: SamplingParams imports
    its structured-output backend to validate any constraint, and that module's class body reads a type of the
    package; only `structured_outputs.backend=lm-format-enforcer` uses it, and then the stand-in raises."""
    routing = _stand_in("prometheus_fastapi_instrumentator.routing")
    _stand_in("prometheus_fastapi_instrumentator", Instrumentator=_NoInstrumentation, routing=routing)
    _stand_in("lmformatenforcer")
    _stand_in("lmformatenforcer.integrations")
    _stand_in("lmformatenforcer.integrations.vllm")


@dataclass
class UvicornStandIn:
    """app.state.server as serve_http sets it: vLLM's handlers set should_exit when the engine is dead."""

    should_exit: bool = False


def start(model_dir: Path, *flags: str, max_model_len: int = 512) -> Server:
    """`vllm serve MODEL_DIR --max-model-len N FLAGS...` as vLLM's parser reads it, built on a fake engine."""
    _stand_ins()
    from vllm.entrypoints.openai.api_server import build_app, init_app_state

    ns, engine_args = VllmCli().serve(["serve", str(model_dir), "--max-model-len", str(max_model_len),
                                       "--enforce-eager", "--language-model-only", *flags])
    vllm_config = engine_args.create_engine_config()
    engine = FakeEngine(vllm_config)
    app = build_app(ns, TASKS, vllm_config.model_config)
    app.state.server = UvicornStandIn()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(init_app_state(engine, app.state, ns, TASKS))
    key = ns.api_key[0] if ns.api_key else None
    model = (ns.served_model_name or [ns.model])[0]
    return Server(app, engine, AsgiClient(app, loop, key), model, max_model_len, loop)
