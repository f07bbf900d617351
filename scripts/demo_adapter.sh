#!/usr/bin/env bash
# Trains the demo SQL adapter (committed in examples/adapters/sql-smollm2-ss4) for the embedded SmolLM2-135M-Instruct and its ntp baseline with
# the same budget, merges both, evaluates both, and writes the model card.
#   bash scripts/demo_adapter.sh [RUNS_DIR]        (~1-2 hours on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs}
BIN=.venv/bin
COMMON="--task sql --num-streams 4 --num-msa-layers 8 --lora-rank 32 --lora-layers msa \
 --steps 400 --batch-size 8 --lr 5e-4 --eval-every 100 --save-every 25 --num-eval 48"
$BIN/specstream train --out "$RUNS/sql-ss4" --objective specstream --stream-lr 2e-2 \
    --stream-init-scale 0.5 --init-rank 32 $COMMON
$BIN/specstream train --out "$RUNS/sql-ntp" --objective ntp $COMMON
for run in sql-ss4 sql-ntp; do
    $BIN/specstream export "$RUNS/$run" "$RUNS/$run-merged" --merge
done
$BIN/specstream eval --checkpoint "$RUNS/sql-ss4-merged" --task sql -n 100 --tree-top-k 2 \
    | tail -n 1 > "$RUNS/sql-ss4-eval.json"
# The baseline's streams are untrained: only its exact match matters (chain only is faster).
$BIN/specstream eval --checkpoint "$RUNS/sql-ntp-merged" --task sql -n 100 --tree-top-k 0 \
    | tail -n 1 > "$RUNS/sql-ntp-eval.json"
$BIN/python -m vllm_specstream.training.model_card "$RUNS/sql-ss4" \
    --eval "$RUNS/sql-ss4-eval.json" --baseline "$RUNS/sql-ntp-eval.json" \
    --command "bash scripts/demo_adapter.sh"
