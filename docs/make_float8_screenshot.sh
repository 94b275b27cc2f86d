#!/usr/bin/env bash
# Regenerates docs/float8-dashboard.png: runs examples/float8_dashboard.py, serves its logs
# with a real TensorBoard on 127.0.0.1 and screenshots the "Custom Scalars" tab with headless
# Chromium (Debian: apt-get install chromium) at TensorBoard's default settings. A developer
# step, not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
logdir=$(mktemp -d)
python examples/float8_dashboard.py --logdir "$logdir" >/dev/null
port=6124
python -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
tb=$!
trap 'kill $tb 2>/dev/null || true; rm -rf "$logdir"' EXIT
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$port/data/plugin/custom_scalars/layout" >/dev/null && break
  sleep 1
done
docs/headless_screenshot.sh "http://127.0.0.1:$port/#custom_scalars" docs/float8-dashboard.png \
  1600,2200 20000
