#!/usr/bin/env bash
# Serve the tiny MoE with routed-expert capture on 127.0.0.1 (foreground; ~25 s to healthy).
#
#   scripts/vllm/serve.sh [PORT] [VENV] [MODEL_DIR]   defaults: 8021  .vllm/venv  .vllm/tinymoe
#
# Flags: --enable-return-routed-experts (capture), --enable-scale-out (the token-in/token-out
# POST /inference/v1/generate), --enable-prefix-caching (capture requires it),
# --skip-tokenizer-init (token ids only; the random model has no tokenizer), float32 and eager
# mode for the CPU. VLLM_CPU_KVCACHE_SPACE=1 keeps the KV cache at 1 GiB (the default sizes it
# to most of memory and starts in about a minute). The `vllm` console script of vllm-cpu is
# broken (its metadata names the distribution vllm-cpu), so the module is run directly.
set -euo pipefail
port=${1:-8021}
venv=${2:-.vllm/venv}
model=${3:-.vllm/tinymoe}
export VLLM_CPU_KVCACHE_SPACE=1 TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1
exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
  --host 127.0.0.1 --port "$port" \
  --enable-return-routed-experts --enable-scale-out --enable-prefix-caching \
  --skip-tokenizer-init --dtype float32 --max-model-len 512 --max-num-seqs 8 --enforce-eager
