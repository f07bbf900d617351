#!/usr/bin/env bash
# Trains the demo SQL adapter (committed in examples/adapters/sql-smollm2-ss4) for the embedded SmolLM2-135M-Instruct and its ntp baseline with
# the same budget, merges both, evaluates both, and writes the model card.
#   bash scripts/demo_adapter.sh [RUNS_DIR]        (~2-3 hours on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs}
BIN=.venv/bin
COMMON="--task sql --num-streams 4 --num-msa-layers 8 --lora-rank 32 --lora-layers msa \
 --batch-size 8 --lr 5e-4 --eval-every 100 --save-every 25 --num-eval 48"
# 400 steps (cosine schedule over 400), then resumed to 600 steps (the schedule restarts at
# its 600-step value): the budget both runs get.
for steps in 400 600; do
    $BIN/specstream train --out "$RUNS/sql-ss4" --objective specstream --stream-lr 2e-2 \
        --stream-init-scale 0.5 --init-rank 32 --steps $steps $COMMON
    $BIN/specstream train --out "$RUNS/sql-ntp" --objective ntp --steps $steps $COMMON
done
for run in sql-ss4 sql-ntp; do
    $BIN/specstream export "$RUNS/$run" "$RUNS/$run-merged"
done
$BIN/specstream eval --checkpoint "$RUNS/sql-ss4-merged" --task sql --tree-top-k 2 \
    | tail -n 1 > "$RUNS/sql-ss4-eval.json"
# The baseline's streams are untrained: only its exact match matters (chain only is faster).
$BIN/specstream eval --checkpoint "$RUNS/sql-ntp-merged" --task sql --tree-top-k 0 \
    | tail -n 1 > "$RUNS/sql-ntp-eval.json"
$BIN/python -m vllm_specstream.training.model_card "$RUNS/sql-ss4" \
    --eval "$RUNS/sql-ss4-eval.json" --baseline "$RUNS/sql-ntp-eval.json" \
    --command "bash scripts/demo_adapter.sh" \
    --note "Steps 1-400 ran with a 400-step schedule, steps 401-600 resumed with --steps 600."
