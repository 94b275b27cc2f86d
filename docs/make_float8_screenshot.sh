#!/usr/bin/env bash
# Regenerates docs/float8-dashboard.png from a real run of examples/float8_dashboard.py, as
# docs/make_dashboard_screenshot.sh does for the loss-scale dashboard. A developer step, not
# part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
docs/make_dashboard_screenshot.sh examples/float8_dashboard.py docs/float8-dashboard.png 1600,2200
