#!/usr/bin/env bash
# Opt-in: run r3arrow's Megatron tests against megatron-core 0.19.x (routers carry `layer_number`).
#
#   scripts/megatron019.sh [VENV] [PYTHON]       defaults: .megatron019/venv  python3.12
#
# megatron-core 0.19 needs Python >= 3.12; the default CI environment (Python 3.11) keeps
# megatron-core 0.16.1. torch 2.13.0 from the package index is a CUDA build (about 5 GB); it runs
# on the CPU, which is all these tests need (gloo, world sizes 1 and 2). Measured on a 2-core
# machine: about 1.5 minutes for the install (warm pip cache), then the 130 tests below (about
# 3 minutes on megatron-core 0.16.1 on the same machine).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.megatron019/venv}
py=${2:-}
if [ -z "$py" ]; then
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python python3.13; do
    if "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      py=$candidate
      break
    fi
  done
fi
"${py:-false}" -c 'import sys; assert sys.version_info >= (3, 12), sys.version' 2>/dev/null || {
  echo "megatron019.sh: needs Python >= 3.12 (pass its path as the second argument)" >&2
  exit 2
}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0" "megatron-core==0.19.2"
"$venv/bin/pip" install -q -e ".[stats,fast,dev]"
"$venv/bin/python" -c 'import megatron.core, torch; print("megatron-core", megatron.core.__version__, "torch", torch.__version__)'
"$venv/bin/pytest" -q -p no:cacheprovider tests/integrations/test_megatron.py \
  tests/integrations/test_megatron_sp.py tests/integrations/test_megatron_mtp.py \
  tests/integrations/test_megatron_probe.py tests/integrations/test_record_routes.py \
  tests/integrations/test_collate.py tests/integrations/test_collate_r3off.py \
  tests/core/test_microbatch.py
