#!/usr/bin/env bash
# Trains, on one real task's training file, the models that share its data and budget: the
# specstream adapter (the paper's joint objective), the next-token (ntp) LoRA baseline and
# Medusa heads (on the merged specstream checkpoint, the model they would serve); merges and
# evaluates them on the development file (never trained on) and writes the adapter's model
# card.
#   bash scripts/real_task.sh sql|e2e|dialogsum TRAIN_FILE DEV_FILE [RUNS_DIR] [STEPS]
# STEPS (batch 8) defaults to the task's budget: one pass over distinct examples before any
# repeats (e2e 2000 steps: 16,000 of 42,061 references; sql 875: all 7,000 questions;
# dialogsum 1000: 8,000 of 12,460 dialogues).
# Resumable: run it again and every run continues from its last checkpoint; finished
# exports and evaluations are kept. MAX_MINUTES=M stops each training run after M minutes
# with a usable adapter (`specstream train --max-minutes`); CHAIN=DIR continues runs from the
# unfinished adapters DIR/TASK-OBJECTIVE (e.g. committed ones) where their data and schedule
# left off (`--continue-from`). OBJECTIVES="specstream ntp" limits the runs;
# OBJECTIVES=two-stage trains streams alone on the ntp baseline merged (frozen), on its own
# greedy replies (written with vLLM, cached in the run directory): the second stage of the
# two-stage objective, whose first stage is the ntp run; both stages become one adapter
# (RUNS/TASK-two-stage-adapter), merged, evaluated and given a model card; with medusa too
# (OBJECTIVES="ntp two-stage medusa"), Medusa heads train on the same frozen model and
# replies with the same budget (RUNS/TASK-two-stage-medusa).
# OBJECTIVES=committed-medusa trains Medusa heads for the task's committed adapter with the
# same budget, on that adapter's own greedy replies (RUNS/TASK-committed-medusa; the adapter
# merged in RUNS/TASK-committed-merged): Table 1's peer baseline without the adapter's runs.
# OBJECTIVES=committed-eagle3 trains an EAGLE-3 drafter the same way (RUNS/TASK-committed-eagle3).
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
# DRAFT_VOCAB_SIZE=N gives the adapter a draft vocabulary of N tokens from the training file
# (`specstream draft-vocab`) before it is merged; 0 (the default) keeps the whole vocabulary.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 sql|e2e|dialogsum TRAIN_FILE DEV_FILE [RUNS_DIR] [STEPS]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
TASK=$1
DATA=$2
DEV=$3
RUNS=${4:-runs}
BIN=${SPECSTREAM_BIN:-.venv/bin}
EVAL_HERE=${SPECSTREAM_EVAL:-1}
case "$TASK" in
    sql) MSA=8; MAXLEN=512; BUDGET=875; COMMITTED=examples/adapters/sql-spider-smollm2-ss4 ;;  # N_s/N ~ 1/4
    e2e) MSA=15; MAXLEN=192; BUDGET=2000; COMMITTED=examples/adapters/e2e-smollm2-ss4 ;;  # N_s/N = 1/2, as the paper
    dialogsum) MSA=15; MAXLEN=768; BUDGET=1000; COMMITTED=examples/adapters/dialogsum-smollm2-ss4 ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
STEPS=${5:-$BUDGET}
# The second stage's replies cost a prefill per dialogue (~0.5 s on 2 cores): DialogSum's are
# written only for the dialogues that one pass of its steps (batch 8) reads.
TWO_STAGE=()
[ "$TASK" = dialogsum ] && TWO_STAGE=(--num-train $((STEPS * 8)))
for f in "$DATA" "$DEV"; do [ -f "$f" ] || { echo "$0: no such file: $f" >&2; exit 2; }; done
RUN=()
if [ -n "${SPECSTREAM_TRAIN_CORE:-}" ]; then
    export OMP_NUM_THREADS=1
    RUN=(taskset -c "$SPECSTREAM_TRAIN_CORE")
fi
COMMON=(--task "$TASK" --data "$DATA" --eval-data "$DEV" --val-fraction 0 --num-streams 4
    --num-msa-layers "$MSA" --lora-rank 32 --lora-layers msa --batch-size 8 --lr 5e-4
    --max-length "$MAXLEN" --steps "$STEPS" --eval-every 250 --save-every 25 --num-eval 64)
[ -n "${MAX_MINUTES:-}" ] && COMMON+=(--max-minutes "$MAX_MINUTES")
[ -n "${SPECSTREAM_DEVICE:-}" ] && COMMON+=(--device "$SPECSTREAM_DEVICE")
[ -n "${SPECSTREAM_DTYPE:-}" ] && COMMON+=(--dtype "$SPECSTREAM_DTYPE")
[ "${SQL_RENAME_COPIES:-0}" != 0 ] &&
    COMMON+=(--sql-rename-copies "$SQL_RENAME_COPIES" ${SQL_RENAME_RATE:+--sql-rename-rate "$SQL_RENAME_RATE"})
OBJECTIVES=${OBJECTIVES:-specstream ntp medusa}
R="$RUNS/$TASK"
EVAL=(--task "$TASK" --data "$DEV" --split all)
has() { [[ " $OBJECTIVES " == *" $1 "* ]]; }
# --continue-from for run $1 where CHAIN holds its unfinished adapter and the run has not
# started here yet.
chain() {
    local from="${CHAIN:-}/$TASK-$1"
    if [ -n "${CHAIN:-}" ] && [ -f "$from/train_state.json" ] && [ ! -d "$R-$1/checkpoint" ]; then
        echo --continue-from "$from"
    fi
}
# A run's adapter is final once its train_state.json says it reached its planned steps;
# until then (MAX_MINUTES) nothing after it runs.
stop_unless_finished() {
    "$BIN/python" -c "import json,sys; s=json.load(open(sys.argv[1])); sys.exit(s['step'] < s['steps'])" \
        "$1/train_state.json" 2>/dev/null && return
    echo "$1: unfinished (MAX_MINUTES); run again to continue"
    exit 0
}
if has specstream; then
    "${RUN[@]}" $BIN/specstream train --out "$R-specstream" --objective specstream "${COMMON[@]}" \
        --init-rank 32 --stream-init-scale 0.5 --stream-lr 2e-2 $(chain specstream)
    stop_unless_finished "$R-specstream"
    if [ "${DRAFT_VOCAB_SIZE:-0}" != 0 ] && [ ! -f "$R-specstream-merged/config.json" ]; then
        $BIN/specstream draft-vocab "$R-specstream" --task "$TASK" --data "$DATA" \
            --size "$DRAFT_VOCAB_SIZE"
    fi
    [ -f "$R-specstream-merged/config.json" ] ||
        $BIN/specstream export "$R-specstream" "$R-specstream-merged"
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-specstream-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-specstream-merged" "${EVAL[@]}" --tree-top-k 2 | tail -n 1 > "$R-specstream-eval.json"
fi
if has ntp; then
    "${RUN[@]}" $BIN/specstream train --out "$R-ntp" --objective ntp "${COMMON[@]}" $(chain ntp)
    stop_unless_finished "$R-ntp"
    # fp32: the two-stage objective's second stage trains on it, and its combined adapter
    # exports the same weights
    [ -f "$R-ntp-merged/config.json" ] ||
        $BIN/specstream export "$R-ntp" "$R-ntp-merged" --dtype float32
    # The baseline has no trained streams: only its task metric matters (chain only). With
    # the two-stage run, whose outputs are the baseline's, that run's evaluation gives it.
    has two-stage || [ "$EVAL_HERE" = 0 ] || [ -s "$R-ntp-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-ntp-merged" "${EVAL[@]}" --tree-top-k 0 | tail -n 1 > "$R-ntp-eval.json"
fi
if has medusa && has specstream; then
    # Heads for the served specstream checkpoint (frozen): what `specstream bench --medusa` runs.
    "${RUN[@]}" $BIN/specstream train --out "$R-medusa" --objective medusa \
        --base "$R-specstream-merged" "${COMMON[@]}"
fi
if [ -s "$R-specstream-eval.json" ]; then
    baseline=()
    [ -s "$R-ntp-eval.json" ] && baseline=(--baseline "$R-ntp-eval.json")
    $BIN/python -m vllm_specstream.training.model_card "$R-specstream" \
        --eval "$R-specstream-eval.json" "${baseline[@]}" \
        --command "bash scripts/real_task.sh $TASK $DATA $DEV RUNS $STEPS"
fi

# The two-stage objective's second stage: streams (and a stream-row LoRA) on the ntp baseline
# merged and frozen, learning its own greedy replies; served, its outputs are the baseline's.
# Both stages then make one adapter of the task's base (RUNS/TASK-two-stage-adapter: the ntp
# LoRA and these streams), which is what is merged, evaluated and served.
if has two-stage; then
    [ -f "$R-ntp-merged/config.json" ] || { echo "two-stage needs the ntp run first" >&2; exit 2; }
    "${RUN[@]}" $BIN/specstream train --out "$R-two-stage" --objective streams-only \
        --base "$R-ntp-merged" "${COMMON[@]}" --init-rank 32 --stream-init-scale 0.5 \
        --stream-lr 2e-2 "${TWO_STAGE[@]}" $(chain two-stage)
    stop_unless_finished "$R-two-stage"
    A="$R-two-stage-adapter"
    # stored in bf16 (half the bytes; what is committed is what is evaluated)
    [ -f "$A/specstream_config.json" ] || $BIN/python -c \
        "import sys, torch; from vllm_specstream.training.checkpoint import two_stage_adapter; two_stage_adapter(*sys.argv[1:], dtype=torch.bfloat16)" \
        "$R-ntp" "$R-two-stage" "$A"
    [ -f "$R-two-stage-merged/config.json" ] ||
        $BIN/specstream export "$A" "$R-two-stage-merged" --dtype float32
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-two-stage-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-two-stage-merged" "${EVAL[@]}" --tree-top-k 0 | tail -n 1 > "$R-two-stage-eval.json"
    # Its outputs are the ntp baseline's: the eval's task metric is the baseline's.
    [ -s "$R-two-stage-eval.json" ] && $BIN/python -m vllm_specstream.training.model_card \
        "$A" --eval "$R-two-stage-eval.json" \
        --note "Two-stage objective: the next-token LoRA (first stage, records in first_stage/), then streams and a LoRA on the stream rows trained on that model merged and frozen, learning its own greedy replies (second stage, the records here); outputs are the next-token model's. The budget also counts the replies (logged by the run)." \
        --command "OBJECTIVES=\"ntp two-stage\" bash scripts/real_task.sh $TASK $DATA $DEV RUNS $STEPS"
    # Medusa heads on the same frozen model, replies and budget: the peer baseline of Table 1
    # (`specstream bench RUNS/TASK-two-stage-merged --medusa RUNS/TASK-two-stage-medusa`).
    if has medusa; then
        "${RUN[@]}" $BIN/specstream train --out "$R-two-stage-medusa" --objective medusa \
            --base "$R-ntp-merged" --distill "$R-two-stage" "${COMMON[@]}" "${TWO_STAGE[@]}"
    fi
fi

# Medusa heads and an EAGLE-3 drafter for the committed adapter: the model it serves, frozen,
# and its own replies (written with vLLM, or Transformers where vLLM is absent), as the
# two-stage run trains them (`specstream bench RUNS/TASK-committed-merged --medusa
# RUNS/TASK-committed-medusa --eagle3 RUNS/TASK-committed-eagle3`).
for DRAFTER in medusa eagle3; do
    has "committed-$DRAFTER" || continue
    [ -f "$R-committed-merged/config.json" ] ||
        $BIN/specstream export "$COMMITTED" "$R-committed-merged" --dtype float32
    "${RUN[@]}" $BIN/specstream train --out "$R-committed-$DRAFTER" --objective "$DRAFTER" \
        --base "$R-committed-merged" --distill "$R-committed-$DRAFTER/self_distill.jsonl" \
        "${COMMON[@]}" "${TWO_STAGE[@]}"
done

if has self-distill; then
    "${RUN[@]}" $BIN/specstream train --out "$R-specstream-sd" --objective specstream \
        "${COMMON[@]}" --init-from "$R-specstream" --distill "$R-specstream-sd/self_distill.jsonl" \
        --init-rank 32 --steps "${SD_STEPS:-200}" --lr 5e-5 --stream-lr 1e-2 --a-j 0.3
    [ -f "$R-specstream-sd-merged/config.json" ] ||
        $BIN/specstream export "$R-specstream-sd" "$R-specstream-sd-merged"
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
        $BIN/specstream export "$R-streams-only" "$R-streams-only-merged"
    [ "$EVAL_HERE" = 0 ] || [ -s "$R-streams-only-eval.json" ] || "${RUN[@]}" $BIN/specstream eval \
        --checkpoint "$R-streams-only-merged" "${EVAL[@]}" --tree-top-k 2 | tail -n 1 > "$R-streams-only-eval.json"
    # Medusa heads on the same frozen base, same replies and budget: what streams-only is
    # measured against (`specstream bench RUN/TASK-streams-only-merged --medusa RUN/TASK-medusa-base`).
    "${RUN[@]}" $BIN/specstream train --out "$R-medusa-base" --objective medusa \
        --distill "$R-streams-only" "${COMMON[@]}"
fi
