#!/usr/bin/env bash
# Run every stage with a preset on a machine without dvc (pipeline.run), then collect the outputs:
# OUT/log.txt, OUT/report.md and OUT/run.tar.gz (results, reports, mlflow.db, the Optuna journal).
# usage: scripts/device-check.sh PRESET OUT [PYTHON]
set -euo pipefail
preset=$1 out=$2 python=${3:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=$(mktemp -d)
status=0
PYTHONUNBUFFERED=1 "$python" -m pipeline.run --params "$preset" --workdir "$work" 2>&1 | tee "$out/log.txt" || status=$?
# Whatever happened, bring back what was measured (the generated images are left behind).
tar -czf "$out/run.tar.gz" -C "$work" --exclude=./data .
if [ -f "$work/reports/report.md" ]; then cp "$work/reports/report.md" "$out/"; fi
exit "$status"
