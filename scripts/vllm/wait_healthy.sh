#!/usr/bin/env bash
# Wait until a vLLM server answers GET /health (exit 0), or give up after TIMEOUT seconds (exit 1).
#
#   scripts/vllm/wait_healthy.sh URL [TIMEOUT] [PID]   PID: fail early if that process died
set -euo pipefail
url=$1
timeout=${2:-180}
pid=${3:-}
for _ in $(seq 1 "$timeout"); do
  if python3 -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$url" 2>/dev/null; then
    echo "vLLM healthy at $url"
    exit 0
  fi
  if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
    echo "vLLM server (pid $pid) exited before it was healthy" >&2
    exit 1
  fi
  sleep 1
done
echo "vLLM at $url not healthy after ${timeout}s" >&2
exit 1
