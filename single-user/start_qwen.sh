#!/usr/bin/env bash
# Single-user mode: one or a few users, MTP or DFlash2 speculative decoding.
# Every knob is an environment variable: single-user/README.md, or python3 -m qwen_serving.knobs --markdown --mode single
#   bash single-user/start_qwen.sh             first start installs and prepares what is missing, then serves
#   bash single-user/start_qwen.sh --dry-run   the exported variables and the exact vllm command
#   bash single-user/start_qwen.sh explain     every derived value and its rule; pool, seats, longest context
exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen_serving/start_server.sh" single "$@"
