#!/usr/bin/env bash
# The type checker (mypy, configured in pyproject.toml) over mlxcel.daemon, .shared and .tui.
# The packages are installed under names setuptools maps onto daemon/, shared/ and tui/ with an
# import hook, which mypy does not follow: it reads them through .typecheck/mlxcel/, links to
# the three directories, and the paths it prints are put back to the repository's.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .typecheck/mlxcel
for p in daemon shared tui; do ln -sfn "../../$p" ".typecheck/mlxcel/$p"; done
set +e
.venv/bin/python -m mypy "$@" | sed 's#^\.typecheck/mlxcel/##'
exit "${PIPESTATUS[0]}"
