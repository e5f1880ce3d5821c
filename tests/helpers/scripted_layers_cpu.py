"""bench/gpu/scripted_layers.py's checks run on vLLM 0.28.0's own qwen3_5 model built on the CPU (float32, the
stand-ins of scripted_vllm_forward.py), against the reference; writes the rows as JSON.

    python tests/helpers/scripted_layers_cpu.py MODEL_DIR OUT.json TOKEN_ID...
    python tests/helpers/scripted_layers_cpu.py --main MODEL_DIR --out OUT.json ...   # the script's main()

The second form runs bench/gpu/scripted_layers.py's main() with `vllm.LLM` replaced by `CpuLLM` below.

OUT.json: {"linears": every decoder linear, the embedding and the lm_head checked against the reference's weights;
"reversed": the fused modules checked with their components in the wrong order; "layers" / "final": the captured
per-layer states against `Reference.layer_states`; "in_situ": the branches split at their output GEMMs;
"scaled", "scaled_in_situ", "scaled_linear": the same after one branch matrix (layer 1's MLP down_proj) is made
SCALE times larger in vLLM's model}.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

# isort: off
from tests.helpers.scripted_vllm_forward import cpu_models  # first: it installs the CPU stand-ins before torch

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from bench.gpu import scripted_layers as sl  # noqa: E402
from qwen_serving.checkpoint.scripted_reference import Reference  # noqa: E402
# isort: on

SCALE = 100.0
SCALED = "layers.1.mlp.down_proj"


def captured(config, target, ids: list[int]) -> dict:
    capture = sl.LayerCapture(target, len(ids))
    with torch.no_grad(), set_forward_context(None, config):
        target(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)).expand(3, -1))
    capture.remove()
    return capture.got


class CpuLLM:
    """The part of vllm.LLM that scripted_layers.main() uses, over the CPU-built target: no engine, greedy
    decoding as full forwards (the hooks keep the first). Records the arguments and the engine environment."""

    def __init__(self, model: str, **kwargs):
        self.config, models = cpu_models(Path(model))
        self.target = models["Qwen3_5ForConditionalGeneration"]
        self.llm_engine = SimpleNamespace(vllm_config=self.config)
        record = {"kwargs": kwargs, "env": {k: os.environ.get(k) for k in sl.ENGINE_ENV}}
        Path(os.environ["QS_CPU_LLM_RECORD"]).write_text(json.dumps(record))

    def apply_model(self, fn):
        return [fn(self.target)]

    def generate(self, prompts, params, use_tqdm=False):
        ids, answer = list(prompts[0]["prompt_token_ids"]), []
        for _ in range(params.max_tokens):
            with torch.no_grad(), set_forward_context(None, self.config):
                hidden = self.target(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)).expand(3, -1))
                answer.append(int(self.target.compute_logits(hidden[-1:]).argmax()))
            ids.append(answer[-1])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=answer, logprobs=None)])]


def main() -> None:
    if sys.argv[1] == "--main":
        vllm.LLM = CpuLLM
        raise SystemExit(sl.main(sys.argv[2:]))
    path, out_path, ids = Path(sys.argv[1]), Path(sys.argv[2]), [int(t) for t in sys.argv[3:]]
    config, models = cpu_models(path)
    target = models["Qwen3_5ForConditionalGeneration"]
    ref = Reference(path)
    cpu, dtype = torch.device("cpu"), torch.float32
    packed = target.packed_modules_mapping
    reversed_packed = {name: parts[::-1] for name, parts in packed.items()}
    states = ref.layer_states(ids)
    with set_current_vllm_config(config):
        linears = sl.decoder_linears(target, len(ref.layer_types))
        out = {"linears": [sl.check_embedding(target, ref, ids, cpu), sl.check_lm_head(target, ref.w, dtype, cpu)]
               + [sl.check_linear(name, module, ref.w, packed, dtype, cpu) for name, module in linears],
               "reversed": [sl.check_linear(name, module, ref.w, reversed_packed, dtype, cpu)
                            for name, module in linears if name.split(".")[-1] in packed]}
        got = captured(config, target, ids)
        out["layers"] = sl.compare_layers(got, states, ref.layer_types)
        out["final"] = sl.compare(got[("final",)], states["final"])
        out["in_situ"] = sl.in_situ(got, states, ref, len(ref.layer_types), cpu)
        (name, module), = [(n, m) for n, m in linears if n.endswith(SCALED)]
        module.quant_method.weight *= SCALE
        out["scaled_linear"] = sl.check_linear(name, module, ref.w, packed, dtype, cpu)
        got = captured(config, target, ids)
        out["scaled"] = sl.compare_layers(got, states, ref.layer_types)
        out["scaled_in_situ"] = sl.in_situ(got, states, ref, len(ref.layer_types), cpu)
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
