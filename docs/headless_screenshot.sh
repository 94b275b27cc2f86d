#!/usr/bin/env bash
# headless_screenshot.sh URL OUT WIDTH,HEIGHT BUDGET_MS: a screenshot of URL (a server on
# 127.0.0.1) with headless Chromium (Debian: apt-get install chromium), no network besides
# it, waiting BUDGET_MS of virtual time for the page to draw. Used by the docs' screenshot
# scripts.
set -euo pipefail
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$(mktemp -d)" --hide-scrollbars --window-size="$3" \
  --virtual-time-budget="$4" --screenshot="$2" "$1"
