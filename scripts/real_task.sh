#!/usr/bin/env bash
# Trains, on one real task, the three models that share data and budget: the specstream
# adapter, the next-token (ntp) LoRA baseline and Medusa heads (on the merged specstream
# checkpoint, the model they would serve); merges and evaluates them on the task file's
# held-out validation split (cut by group, seed 0) and writes the adapter's model card.
#   bash scripts/real_task.sh sql|e2e|dialogsum DATA_FILE [RUNS_DIR] [STEPS]
# Resumable: run it again and every run continues from its last checkpoint; finished
# exports and evaluations are kept. OBJECTIVES="specstream ntp" limits the runs;
# OBJECTIVES=streams-only trains streams on the frozen base and Medusa heads beside them.
# OBJECTIVES=self-distill continues the trained specstream adapter on its own greedy replies
# (written with vLLM by the adapter merged; SD_STEPS steps, default 200, small LoRA learning
# rate) into RUNS/TASK-specstream-sd, then merges and evaluates it.
# SPECSTREAM_TRAIN_CORE=N pins the training to one core (1 thread), leaving the other free.
# SPECSTREAM_DEVICE=cuda trains on a GPU; SPECSTREAM_EVAL=0 trains and exports only (run the
# script again without it, e.g. on the CPU machine, for the evaluations and the model card);
# SPECSTREAM_DTYPE=fp32|bf16 sets the training precision (default: auto);
# SQL_RENAME_COPIES=N (task sql) adds N schema-renamed copies of each training record
# (`--sql-rename-copies`; SQL_RENAME_RATE sets `--sql-rename-rate`, else train's default) to
# every model's training data.
# SPECSTREAM_BIN names the directory of the `specstream` and `python` to use.
# DRAFT_VOCAB_SIZE=N gives the adapter a draft vocabulary of N tokens from the training split
# (`specstream draft-vocab`) before it is merged; 0 (the default) keeps the whole vocabulary.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=$1
DATA=$2
RUNS=${3:-runs}
STEPS=${4:-600}
BIN=${SPECSTREAM_BIN:-.venv/bin}
EVAL_HERE=${SPECSTREAM_EVAL:-1}
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
[ -n "${SPECSTREAM_DEVICE:-}" ] && COMMON+=(--device "$SPECSTREAM_DEVICE")
[ -n "${SPECSTREAM_DTYPE:-}" ] && COMMON+=(--dtype "$SPECSTREAM_DTYPE")
[ "${SQL_RENAME_COPIES:-0}" != 0 ] &&
    COMMON+=(--sql-rename-copies "$SQL_RENAME_COPIES" ${SQL_RENAME_RATE:+--sql-rename-rate "$SQL_RENAME_RATE"})
OBJECTIVES=${OBJECTIVES:-specstream ntp medusa}
R="$RUNS/$TASK"
EVAL=(--task "$TASK" --data "$DATA" --split val)
has() { [[ " $OBJECTIVES " == *" $1 "* ]]; }
if has specstream; then
    "${RUN[@]}" $BIN/specstream train --out "$R-specstream" --objective specstream "${COMMON[@]}" \
        --init-rank 32 --stream-init-scale 0.5 --stream-lr 2e-2
    if [ "${DRAFT_VOCAB_SIZE:-0}" != 0 ] && [ ! -f "$R-specstream-merged/config.json" ]; then
        $BIN/specstream draft-vocab "$R-specstream" --task "$TASK" --data "$DATA" \
            --size "$DRAFT_VOCAB_SIZE"
    fi
    [ -f "$R-specstream-merged/config.json" ] ||
        $BIN/specstream export "$R-specstream" "$R-specstream-merged" --merge
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-specstream-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-specstream-merged" "${EVAL[@]}" --tree-top-k 2 | tail -n 1 > "$R-specstream-eval.json"
fi
if has ntp; then
    "${RUN[@]}" $BIN/specstream train --out "$R-ntp" --objective ntp "${COMMON[@]}"
    [ -f "$R-ntp-merged/config.json" ] || $BIN/specstream export "$R-ntp" "$R-ntp-merged" --merge
    # The baseline has no trained streams: only its task metric matters (chain only).
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-ntp-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-ntp-merged" "${EVAL[@]}" --tree-top-k 0 | tail -n 1 > "$R-ntp-eval.json"
fi
if has medusa; then
    # Heads for the served specstream checkpoint (frozen): what `specstream bench --medusa` runs.
    "${RUN[@]}" $BIN/specstream train --out "$R-medusa" --objective medusa \
        --base "$R-specstream-merged" "${COMMON[@]}"
fi
if [ -s "$R-specstream-eval.json" ]; then
    baseline=()
    [ -s "$R-ntp-eval.json" ] && baseline=(--baseline "$R-ntp-eval.json")
    $BIN/python -m vllm_specstream.training.model_card "$R-specstream" \
        --eval "$R-specstream-eval.json" "${baseline[@]}" \
        --command "bash scripts/real_task.sh $TASK $DATA RUNS $STEPS"
fi

if has self-distill; then
    "${RUN[@]}" $BIN/specstream train --out "$R-specstream-sd" --objective specstream \
        "${COMMON[@]}" --init-from "$R-specstream" --distill "$R-specstream-sd/self_distill.jsonl" \
        --init-rank 32 --steps "${SD_STEPS:-200}" --lr 5e-5 --stream-lr 1e-2 --a-j 0.3
    [ -f "$R-specstream-sd-merged/config.json" ] ||
        $BIN/specstream export "$R-specstream-sd" "$R-specstream-sd-merged" --merge
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-specstream-sd-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-specstream-sd-merged" "${EVAL[@]}" --tree-top-k 2 | tail -n 1 > "$R-specstream-sd-eval.json"
fi

# Streams on the frozen base (OBJECTIVES=streams-only): trained on the base model's own
# replies, which vLLM writes first; pinned to one core, its own binding must not reserve a
# core for its scheduler.
if has streams-only; then
    [ -n "${SPECSTREAM_TRAIN_CORE:-}" ] && export VLLM_CPU_OMP_THREADS_BIND=nobind
    "${RUN[@]}" $BIN/specstream train --out "$R-streams-only" --objective streams-only \
        "${COMMON[@]}" --init-rank 32 --stream-init-scale 0.5 --stream-lr 2e-2
    [ -f "$R-streams-only-merged/config.json" ] ||
        $BIN/specstream export "$R-streams-only" "$R-streams-only-merged" --merge
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-streams-only-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-streams-only-merged" "${EVAL[@]}" --tree-top-k 2 | tail -n 1 > "$R-streams-only-eval.json"
    # Medusa heads on the same frozen base, same replies and budget: what streams-only is
    # measured against (`specstream bench RUN/TASK-streams-only-merged --medusa RUN/TASK-medusa-base`).
    "${RUN[@]}" $BIN/specstream train --out "$R-medusa-base" --objective medusa \
        --distill "$R-streams-only" "${COMMON[@]}"
fi
