#!/usr/bin/env bash
# Installs the npm packages of the deploy checks, exactly as deploy/lint/package-lock.json pins
# them, into DEST/node_modules (a build folder, so the source tree stays clean). Skips the
# install when DEST already holds this lockfile's packages.
#   usage: deploy/lint/install.sh DEST
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:?usage: $0 DEST}"

if ! command -v npm >/dev/null 2>&1; then
  echo "deploy/lint/install.sh: npm not found; run deploy/install-deps.sh" >&2
  exit 1
fi
mkdir -p "$dest"
if [[ -d "$dest/node_modules" ]] && cmp -s "$here/package-lock.json" "$dest/package-lock.json"; then
  echo "deploy/lint: npm packages up to date in $dest"
  exit 0
fi
cp "$here/package.json" "$here/package-lock.json" "$dest/"
npm ci --prefix "$dest" --no-audit --no-fund --loglevel=error
echo "deploy/lint: npm packages installed in $dest"
