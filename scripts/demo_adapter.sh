#!/usr/bin/env bash
# Trains the demo SQL adapter for the embedded SmolLM2-135M-Instruct and its ntp baseline with
# the same budget, merges both, evaluates both, and writes the model card.
#   bash scripts/demo_adapter.sh [RUNS_DIR]        (~1-2 hours on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs}
BIN=.venv/bin
COMMON="--task sql --num-streams 4 --num-msa-layers 8 --lora-rank 32 --lora-layers msa \
 --steps 400 --batch-size 8 --lr 5e-4 --eval-every 100 --save-every 25 --num-eval 48"
$BIN/specstream train --out "$RUNS/sql-ss4" --objective specstream --stream-lr 2e-2 \
    --stream-init-scale 0.5 $COMMON
$BIN/specstream train --out "$RUNS/sql-ntp" --objective ntp $COMMON
for run in sql-ss4 sql-ntp; do
    $BIN/specstream export "$RUNS/$run" "$RUNS/$run-merged" --merge
    $BIN/specstream eval --checkpoint "$RUNS/$run-merged" --task sql -n 100 \
        | tail -n 1 > "$RUNS/$run-eval.json"
done
$BIN/python -m vllm_specstream.training.model_card "$RUNS/sql-ss4" \
    --eval "$RUNS/sql-ss4-eval.json" --baseline "$RUNS/sql-ntp-eval.json" \
    --command "bash scripts/demo_adapter.sh"
