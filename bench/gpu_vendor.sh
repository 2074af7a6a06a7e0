#!/usr/bin/env bash
# Optional step before the GPU check: copy pytest and the pure-Python packages it imports into
# build/gpu-vendor/ (git-ignored), so a GPU machine without pytest still runs the kernel tests.
# The GPU machine then needs the folder: copy the repository with build/gpu-vendor/. gpu_check.sh
# puts it on PYTHONPATH only when the machine's python3 cannot import pytest itself.
#
# From the course's .venv: pytest, _pytest, py.py, pluggy, iniconfig, pygments and packaging
# (pytest 9 needs packaging >= 22; transformers accepts older). On Python 3.10 pytest also needs
# exceptiongroup and tomli (3.11 has both built in): copied from the .venv if there, else
# downloaded as pure-Python wheels with pip (one registry look-up); if that fails the folder
# still works on Python >= 3.11 and the script says so. exceptiongroup imports typing_extensions,
# which is not copied: torch depends on it, so the GPU machine has it. No __pycache__: ~7 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=build/gpu-vendor
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$DEST"
mkdir -p "$DEST"
for name in pytest _pytest py.py pluggy iniconfig pygments packaging exceptiongroup tomli; do
  if [ -e "$SITE/$name" ]; then
    cp -r "$SITE/$name" "$DEST/"
  elif [ "$name" != exceptiongroup ] && [ "$name" != tomli ] && [ "$name" != py.py ]; then
    echo "error: $name is not in $SITE (run make setup first)" >&2
    exit 1
  fi
done
missing=()
for name in exceptiongroup tomli; do
  [ -e "$DEST/$name" ] || missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then
  wheels=$(mktemp -d)
  if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.10 \
      --implementation py --abi none --platform any -d "$wheels" "${missing[@]}" 2>/dev/null; then
    for whl in "$wheels"/*.whl; do
      "$PY" -m zipfile -e "$whl" "$DEST"
    done
    rm -rf "$DEST"/*.dist-info
  else
    echo "warning: could not fetch ${missing[*]}: pytest from $DEST needs Python >= 3.11"
  fi
  rm -rf "$wheels"
fi
find "$DEST" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "vendored into $DEST ($(du -sh "$DEST" | cut -f1)): $(ls "$DEST" | tr '\n' ' ')"
