#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or explain why there is none and exit 1.
# Order: $KDA_PYTHON, the repo's .python-version through pyenv, python3.13/3.12, python3.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
[ -n "${KDA_PYTHON:-}" ] && candidates+=("$KDA_PYTHON")
if command -v pyenv >/dev/null 2>&1; then
  want=$(cat "$root/.python-version" 2>/dev/null || true)
  for v in $want $(pyenv versions --bare 2>/dev/null | sort -rV); do
    p="$(pyenv root)/versions/$v/bin/python3"
    [ -x "$p" ] && candidates+=("$p")
  done
fi
for name in python3.13 python3.12 python3; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
for p in "${candidates[@]}"; do
  if ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: no Python >= 3.12 found (jax 0.11.2 needs it). Tried: ${candidates[*]:-nothing}." >&2
echo "       Install one (e.g. 'pyenv install 3.12.1') or set KDA_PYTHON=/path/to/python3.12." >&2
exit 1
