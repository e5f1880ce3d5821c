#!/usr/bin/env bash
# Batch mode: throughput for many concurrent requests, int8-activation GEMMs.
# Every knob is an environment variable: batch/README.md, or python3 -m qwen_serving.knobs --markdown --mode batch
#   bash batch/start_qwen.sh             first start installs and prepares what is missing, then serves
#   bash batch/start_qwen.sh --dry-run   the exported variables and the exact vllm command
#   bash batch/start_qwen.sh explain     every derived value and its rule; pool, seats, longest context
exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen_serving/start_server.sh" batch "$@"
