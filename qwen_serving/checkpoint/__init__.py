"""Offline checkpoint work: download, transactional rewrites, config edits, the MTP draft vocabulary,
int4/int8 quantization, synthetic checkpoints and the prepare-status report.

Nothing here runs inside vLLM and nothing imports it: these modules read and write safetensors
directories with numpy (torch only where a synthetic checkpoint is generated).
"""
