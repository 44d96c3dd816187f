#!/usr/bin/env bash
# GPU check of issue 13 (<= 3 minutes): collation with device="cuda" and replay on CUDA
# against the CPU result; exits non-zero on a mismatch, prints a skip without CUDA.
# Usage: benchmarks/gpu_check.sh [--trajectories N] [--tokens T]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec timeout 180 "$PY" benchmarks/gpu_check.py "$@"
