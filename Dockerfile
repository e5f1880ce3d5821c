# qwen-serving image: CUDA 13 runtime, Python 3.12 venv, the pinned stack (install.sh: vllm==0.28.0,
# torch 2.13.0), the patch series applied and `verify.sh --install` run at build. Models are not in
# the image: docker-compose.yml mounts ./models and each profile's prepare service fills it.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HF_HOME=/opt/qwen-serving/models/.hf-cache HF_XET_HIGH_PERFORMANCE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
      build-essential git patch ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/qwen-serving
# The install layer depends only on what install.sh reads, so code edits do not reinstall the stack.
COPY pyproject.toml README.md install.sh verify.sh ./
COPY qwen_serving/ qwen_serving/
COPY patches/ patches/
RUN PYTHON=python3.12 bash install.sh

COPY . .
# QS_CONTAINER: a refusal tells the user to set the knob in the host's .env (qwen_serving/start_server.sh)
ENV PATH=/opt/qwen-serving/venv/bin:$PATH QS_CONTAINER=1
EXPOSE 18020
CMD ["bash", "single-user/start_qwen.sh"]
