#!/usr/bin/env bash
# Sourced by bin/noria and bin/test: makes .venv and installs noria into it
# (editable) when it is missing or pyproject.toml changed. Usage: bootstrap.sh [extras]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${1:-}"
python="${NORIA_PYTHON:-python3}"
inputs=("$root/pyproject.toml")
[ -f "$root/kernels/requirements-test.txt" ] && inputs+=("$root/kernels/requirements-test.txt")
want="$(cat "${inputs[@]}" | sha256sum | cut -c1-16)-$extras"
stamp="$venv/.noria-installed"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if ! grep -qx -- "$want" "$stamp" 2>/dev/null; then
  echo "noria: setting up $venv (first run takes a few minutes)" >&2
  # Pinned first, so pip takes the local CPU wheel instead of the CUDA build.
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$spec"
  if [ "$extras" = "test" ] && [ -f "$root/kernels/requirements-test.txt" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$root/kernels/requirements-test.txt"
  fi
  echo "$want" >> "$stamp"
fi
