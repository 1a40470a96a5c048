#!/usr/bin/env bash
# Serve the bundled tiny Kimi-Linear with the plugin's attention backend and DSPARK speculation
# (block size 3) on http://127.0.0.1:${PORT:-30000}. Stop it with Ctrl-C.
#
#   examples/launch_server.sh                 # then: python examples/openai_client.py
#   GAMMA=1 PORT=30001 examples/launch_server.sh --enable-linear-replayssm-spec --linear-replayssm-cache-len 4
#
# Without a GPU it runs on CPU under the Triton interpreter and adds the flags a CPU-only run
# needs (printed by sglang_dspark_plugin.harness.serving.cpu_flags; docs/guide/cpu-testing.md
# explains each one).
# For real models see configs/deploy/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
GAMMA=${GAMMA:-3}

"$PY" -m sglang_dspark_plugin.harness.tiny_models          # writes the tiny weights if missing

args=(
  --model-path configs/tiny-kimi-linear
  --attention-backend dspark
  --speculative-algorithm DSPARK
  --speculative-draft-model-path configs/tiny-dspark-draft
  --speculative-dspark-block-size "$GAMMA"
  --host 127.0.0.1 --port "${PORT:-30000}"
)
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  # the environment of a CPU-only run (harness.serving.cpu_env): Triton's interpreter, and the
  # plugin's CPU-only SGLang patches (SGLANG_DSPARK_CPU=1), without which SGLang refuses DSPARK on CPU
  while read -r kv; do export "${kv?}"; done < <("$PY" -c 'from sglang_dspark_plugin.harness.serving import cpu_env
for k, v in cpu_env().items(): print(f"{k}={v}")')
  read -r -a cpu < <("$PY" -c 'from sglang_dspark_plugin.harness.serving import cpu_flags; print(" ".join(cpu_flags(speculative=True)))')
  args+=("${cpu[@]}")
fi
echo "+ $PY -m sglang.launch_server ${args[*]} $*"
exec "$PY" -m sglang.launch_server "${args[@]}" "$@"
