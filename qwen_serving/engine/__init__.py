"""Everything that runs inside the vLLM 0.28.0 process: the hooks our patches call, and kernels/.

Naming rule: a hook module is named `<component>_<change>`, where component is the part of vLLM it
hooks (one of HOOK_COMPONENTS) and change says what it does there, e.g. `attn_routing` (which attention
kernel a call takes), `gdn_spec_bounds` (the GDN kernels' speculative-slot bounds) or `env_vars` (the
VLLM_* variables the patches add to vllm/envs.py). Patches import only from this package; nothing
here imports the planning modules of `qwen_serving` (plan, knobs, memory, patchset, model).
tests/test_structure.py enforces both.
"""

# api: the HTTP server; spec: speculative decoding on the V2 runner; vision: the multimodal encoder;
# worker: the V1 GPU worker and its model runner's own steps (v1/worker/gpu_worker.py, gpu_model_runner.py)
HOOK_COMPONENTS = ("attn", "sampler", "marlin", "mtp", "kv", "gdn", "env", "api", "spec", "vision", "worker")
