#!/usr/bin/env bash
# Everything from a fresh clone to a passing test suite: set up, pull the default model, lint,
# type-check, test. Each phase's seconds go to stderr (where a run's time goes, docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Let Python cache bytecode, whatever the environment says (some images set
# PYTHONDONTWRITEBYTECODE=1): without it pytest rewrites every test module's asserts again in each
# worker (~5 s of CPU each) and each of the suite's ~360 Python processes compiles the modules
# it imports that have no .pyc (importing the daemon and the console: 1.2 s of CPU, 0.85 s cached).
unset PYTHONDONTWRITEBYTECODE
start=$SECONDS
mark=$SECONDS
phase() { echo "test.sh: $1 in $((SECONDS - mark)) s" >&2; mark=$SECONDS; }
scripts/setup.sh --dev
phase "set up"
# The type checker (one core, ~15 s) runs beside the model's pull and the tests' start; its
# verdict is read after the tests.
typecheck_log=.venv/typecheck.log
scripts/typecheck.sh >"$typecheck_log" 2>&1 &
typecheck=$!
trap 'kill "$typecheck" 2>/dev/null || true' EXIT INT TERM  # a failed step leaves no checker behind
.venv/bin/mlxcel-daemon models pull
phase "default model pulled"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
phase "linted"
# Two workers, a test file per worker at a time (docs/testing.md): a file's module-scoped
# daemon starts once, and one file's waits overlap the other's work. Files go out in
# tests/conftest.py's order (long e2e files first, short unit files last), not xdist's
# default of the files with the most tests first, which left the long few-test e2e files
# for the end, one worker busy and the other idle.
status=0
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@" || status=$?
phase "tests"
typed=0
wait "$typecheck" || typed=$?
cat "$typecheck_log"
[ "$typed" = 0 ] || echo "test.sh: the type checker failed (above)" >&2
echo "test.sh: $((SECONDS - start)) s in all" >&2
[ "$status" = 0 ] || exit "$status"
exit "$typed"
