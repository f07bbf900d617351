#!/usr/bin/env bash
# Trains, on one real task, the three models that share data and budget: the specstream
# adapter, the next-token (ntp) LoRA baseline and Medusa heads; then merges and evaluates
# them on the task file's held-out validation split (cut by group, seed 0).
#   bash scripts/real_task.sh sql|e2e|dialogsum DATA_FILE [RUNS_DIR] [STEPS]
# Resumable: run it again and every run continues from its last checkpoint.
# SPECSTREAM_TRAIN_CORE=N pins the training to one core (1 thread), leaving the other free.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=$1
DATA=$2
RUNS=${3:-runs}
STEPS=${4:-600}
BIN=.venv/bin
case "$TASK" in
    sql) MSA=8; MAXLEN=512 ;;          # N_s/N ~ 1/4 (the demo adapter's setting)
    e2e) MSA=15; MAXLEN=192 ;;         # N_s/N = 1/2, as the paper for text tasks
    dialogsum) MSA=15; MAXLEN=768 ;;
    *) echo "usage: $0 sql|e2e|dialogsum DATA_FILE [RUNS_DIR] [STEPS]" >&2; exit 2 ;;
esac
RUN=()
if [ -n "${SPECSTREAM_TRAIN_CORE:-}" ]; then
    export OMP_NUM_THREADS=1
    RUN=(taskset -c "$SPECSTREAM_TRAIN_CORE")
fi
COMMON=(--task "$TASK" --data "$DATA" --num-streams 4 --num-msa-layers "$MSA" --lora-rank 32
    --lora-layers msa --batch-size 8 --lr 5e-4 --max-length "$MAXLEN" --steps "$STEPS"
    --eval-every 100 --save-every 20 --num-eval 48)
for objective in ${OBJECTIVES:-specstream ntp medusa}; do
    extra=()
    [ "$objective" = specstream ] && extra=(--init-rank 32 --stream-init-scale 0.5 --stream-lr 2e-2)
    "${RUN[@]}" $BIN/specstream train --out "$RUNS/$TASK-$objective" --objective "$objective" \
        "${COMMON[@]}" "${extra[@]}"
done
