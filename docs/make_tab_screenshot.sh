#!/usr/bin/env bash
# Regenerates docs/mixed-precision-tab.png: runs `tfmixprec demo` (its runs: the policy this
# machine trains fastest in, then the float16 phase in which a layer overflows, is diagnosed
# and repaired), serves its logs with a real TensorBoard on 127.0.0.1 and screenshots the
# "Mixed precision" tab with headless Chromium (Debian: apt-get install chromium), as a
# newcomer first sees it. A developer step, not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/mixed-precision-tab.png}
size=${2:-1500,1640}
logdir=$(mktemp -d)
tfmixprec demo --quiet --epochs 2 --logdir "$logdir" >/dev/null
port=6124
python -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
tb=$!
trap 'kill $tb 2>/dev/null || true; rm -rf "$logdir"' EXIT
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$port/data/plugin/tfmixprec/runs" | grep -q train && break
  sleep 1
done
docs/headless_screenshot.sh "http://127.0.0.1:$port/#tfmixprec" "$out" "$size" 20000
