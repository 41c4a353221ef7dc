#!/usr/bin/env bash
# Installs Debian's headless Chromium for the playground test when it is missing.
# Called by bin/test (and by tests/test_bridge_websocket.py itself as a fallback).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup_browser: chromium is missing and this user cannot apt-get install it" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
