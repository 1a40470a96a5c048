#!/usr/bin/env bash
# Stage sglang 0.5.23's Triton KDA kernels (and fla-core 0.6.0) for bench_kernels.py on a GPU machine
# that has neither package nor a package index. Run from the repository root; everything lands in
# .whl/ (git-ignored), which is copied to the GPU machine with the checkout:
#   .whl/upstream/sglang/...   the handful of kernel files bench_kernels.py loads (empty package inits;
#                              the runtime helpers they import are stubbed by the harness)
#   .whl/fla_core-*.whl        optional, fla's fused_recurrent_kda decode baseline
# Source: an importable sglang==0.5.23 when there is one (the project's venv), else the wheel.
set -euo pipefail
PY=${PYTHON:-python3}
mkdir -p .whl/upstream
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
FILES="kernels/ops/mamba/causal_conv1d_triton.py
kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py
kernels/ops/attention/linear/fused_kda_conv_recurrent_verify.py
kernels/ops/attention/linear/kda_replayssm_spec_decode.py
kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py
kernels/ops/attention/fla/fused_recurrent.py
kernels/ops/attention/fla/fused_norm_gate.py
kernels/ops/attention/fla/op.py
kernels/ops/attention/fla/utils.py"
SRC=$($PY -c 'import os, sglang; print(os.path.dirname(sglang.__file__))' 2>/dev/null || true)
VER=$($PY -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [ -z "$SRC" ] || [ "$VER" != "0.5.23" ]; then
  $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d /tmp/sglang-wheel sglang==0.5.23
  rm -rf /tmp/sglang-src && mkdir -p /tmp/sglang-src
  (cd /tmp/sglang-src && unzip -q /tmp/sglang-wheel/sglang-0.5.23-*.whl 'sglang/kernels/*')
  SRC=/tmp/sglang-src/sglang
fi
for f in $FILES; do
  mkdir -p ".whl/upstream/sglang/$(dirname "$f")"
  cp "$SRC/$f" ".whl/upstream/sglang/$f"
done
# empty package inits so importing a kernel file pulls in nothing else
find .whl/upstream/sglang -type d -exec sh -c 'touch "$1/__init__.py"' _ {} \;
echo "sglang 0.5.23 kernels from $SRC" > .whl/upstream/SOURCE
ls .whl/fla_core-0.6.0-*.whl >/dev/null 2>&1 || \
  $PY -m pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0 || echo "fla-core not fetched (optional)"
du -sh .whl
