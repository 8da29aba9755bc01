#!/usr/bin/env bash
# Everything from a fresh clone to a passing test suite: set up, pull the default model, lint,
# type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/mlxcel-daemon models pull
.venv/bin/ruff check .
.venv/bin/ruff format --check .
scripts/typecheck.sh
# Two workers, a test file per worker at a time (docs/testing.md): a file's module-scoped
# daemon starts once, and one file's waits overlap the other's work.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
