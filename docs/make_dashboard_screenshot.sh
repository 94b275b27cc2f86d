#!/usr/bin/env bash
# Regenerates docs/dashboard.png: runs examples/tensorboard_dashboard.py, serves its logs with a
# real TensorBoard on 127.0.0.1 and screenshots the "Custom Scalars" tab with headless Chromium
# (Debian: apt-get install chromium) at TensorBoard's default settings (smoothing 0.6, outliers
# ignored in chart scaling), as a newcomer first sees it. A developer step, not part of CI.
# With arguments EXAMPLE OUT WIDTH,HEIGHT it does the same for another example
# (docs/make_float8_screenshot.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
example=${1:-examples/tensorboard_dashboard.py}
out=${2:-docs/dashboard.png}
size=${3:-1600,1460}
logdir=$(mktemp -d)
python "$example" --logdir "$logdir" >/dev/null
port=6123
python -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
tb=$!
trap 'kill $tb 2>/dev/null || true; rm -rf "$logdir"' EXIT
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$port/data/plugin/custom_scalars/layout" >/dev/null && break
  sleep 1
done
docs/headless_screenshot.sh "http://127.0.0.1:$port/#custom_scalars" "$out" "$size" 20000
