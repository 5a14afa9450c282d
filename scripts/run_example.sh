#!/usr/bin/env bash
# Installs everything, trains examples/train_mlp.py under steptrace on the CPU, and prints
# the run's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
"$VENV/bin/python" examples/train_mlp.py runs/train_mlp
"$VENV/bin/steptrace" summary runs/train_mlp
