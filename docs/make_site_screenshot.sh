#!/usr/bin/env bash
# Regenerates docs/site-front.png: builds the docs site (mkdocs.yml) into a temporary folder,
# serves it on 127.0.0.1 and screenshots its front page with headless Chromium (Debian:
# apt-get install chromium; the site: pip install ".[docs]"). A developer step, not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$site"
port=6124
python -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$site"' EXIT
for _ in $(seq 30); do
  curl -sf "http://127.0.0.1:$port/" >/dev/null && break
  sleep 0.5
done
docs/headless_screenshot.sh "http://127.0.0.1:$port/" docs/site-front.png 1400,1000 10000
