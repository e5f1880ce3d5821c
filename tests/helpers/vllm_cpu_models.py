"""vLLM 0.28.0's own qwen3_5 target and MTP drafter, built and loaded on the CPU from a checkpoint's tensors.

For subprocess scripts only: `start_cpu_world` stubs vLLM's missing compiled ops (`vllm._C` is not built for
the CPU) and initialises a one-process torch.distributed world. Import it after
`qwen_serving.engine.cpu_compat.install()` has run (the script does that first).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype


class NoCompiledOps:
    """torch.ops._C on the CPU: layers look ops up at init; calling one is a bug of the script."""

    def __getattr__(self, name):
        def op(*args, **kwargs):
            raise RuntimeError(f"vllm._C.{name} called")

        return op


def engine_config(path: Path, num_speculative_tokens: int, max_model_len: int, vision_argv: list[str] | None = None):
    """The engine config `vllm serve PATH --language-model-only` with MTP would build; with `vision_argv` (the
    plan's VISION=1 flags, parsed by vLLM's own parser) the tower is built instead of --language-model-only."""
    vision = {}
    if vision_argv is not None:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(vision_argv)
        vision = {"limit_mm_per_prompt": parsed.limit_mm_per_prompt, "mm_processor_kwargs": parsed.mm_processor_kwargs}
    return EngineArgs(model=str(path), language_model_only=vision_argv is None, max_model_len=max_model_len,
                      enforce_eager=True, **vision,
                      speculative_config={"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
                      ).create_engine_config()


def start_cpu_world(vllm_config) -> None:
    """Stub the compiled ops and start a one-process gloo world on a free loopback port (once a process)."""
    torch.ops._C = NoCompiledOps()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)


def load_models(vllm_config, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                device: str = "cpu") -> dict[str, tuple[int, torch.nn.Module]]:
    """Target and drafter by class name: (tensors their load_weights took, the model). Raises when vLLM's
    loader finds a parameter left unfilled. `weights()` yields the checkpoint's (name, tensor) pairs."""
    out = {}
    loader = DefaultModelLoader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config):
        for model_config in (vllm_config.model_config, vllm_config.speculative_config.draft_model_config):
            with set_default_torch_dtype(model_config.dtype), torch.device(device):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            loaded = set(model.load_weights(iter(weights())))
            out[type(model).__name__] = (len(loaded), model)  # counted first: the check adds to the set
            loader.track_weights_loading(model, loaded)
    return out
