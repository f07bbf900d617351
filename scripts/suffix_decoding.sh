#!/usr/bin/env bash
# Builds vLLM's `suffix` speculative method's dependency for this CPU: arctic-inference's
# suffix tree (a small C++ extension). PyPI has only its sdist, whose build also wants CUDA
# tooling and whose package registers a vLLM plugin that breaks a vLLM 0.32 engine when
# ARCTIC_INFERENCE_ENABLED is set. So: build the wheel in a throw-away venv (the project's
# torch only imported, read-only), and install only the suffix-decoding files, without the
# plugin's entry point, into DEST, which `specstream bench` puts on its engines' PYTHONPATH.
#   bash scripts/suffix_decoding.sh [DEST]    (idempotent; ~2 min the first time)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.0
DEST=${1:-${SPECSTREAM_SUFFIX_DECODING:-$HOME/.cache/vllm-specstream/suffix-decoding}}
PY=.venv/bin/python
if PYTHONPATH="$DEST" $PY -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    echo "suffix decoding ready: $DEST"; exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE_PY=$($PY -c 'import sys; print(sys.base_prefix)')/bin/python3
"$BASE_PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "setuptools>=61" wheel ninja "cmake>=3.12" "nanobind==2.9.2" \
    "protobuf==5.29.6" grpcio-tools
# setup.py imports torch only for its CMake prefix: the project's, appended, never modified.
echo "$SITE" > "$WORK/venv/lib/python3.$($PY -c 'import sys; print(sys.version_info[1])')/site-packages/zz_project.pth"
PATH="$WORK/venv/bin:$PATH" "$WORK/venv/bin/pip" download -q --no-deps --no-build-isolation \
    --no-binary :all: -d "$WORK" "arctic-inference==$VERSION"
tar xzf "$WORK/arctic_inference-$VERSION.tar.gz" -C "$WORK"
(cd "$WORK/arctic_inference-$VERSION" && PATH="$WORK/venv/bin:$PATH" \
    "$WORK/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$WORK/wheels" .)
$PY -m zipfile -e "$WORK"/wheels/arctic_inference-*.whl "$WORK/x"
rm -rf "$DEST" && mkdir -p "$DEST/arctic_inference/suffix_decoding"
install -m 644 "$WORK/x/arctic_inference/__init__.py" "$DEST/arctic_inference/"
install -m 644 "$WORK/x/arctic_inference-$VERSION.dist-info/LICENSE" "$DEST/arctic_inference/"
install -m 644 "$WORK/x/arctic_inference/suffix_decoding/__init__.py" \
    "$WORK/x/arctic_inference/suffix_decoding/cache.py" "$DEST/arctic_inference/suffix_decoding/"
install -m 755 "$WORK"/x/arctic_inference/suffix_decoding/_C.*.so "$DEST/arctic_inference/suffix_decoding/"
PYTHONPATH="$DEST" $PY -c '
import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache
c = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=8)
c.start_request("r", np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], dtype=np.int32))
c.add_active_response("r", [3])
assert c.speculate("r", np.array([1, 2, 3], dtype=np.int32), max_spec_tokens=4).token_ids == [4, 5]'
echo "suffix decoding ready: $DEST"
