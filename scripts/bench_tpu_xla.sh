#!/usr/bin/env bash
# The tpu backend on XLA:CPU against the cpu backend, same model, same load, one after the other:
# tgis serve (cpu, float32, 4 sequences x 512) vs tgis serve --backend tpu (HF_BATCH_SIZE=4,
# HF_SEQUENCE_LENGTH=512) in insert and rebuild prefill modes, each load-tested by
# tgis benchmark (4 closed-loop users, 64-token prompts, 32 new tokens, 30 s).
# Needs .venv (make install) and .venv-xla (make test-xla). Results: $OUT/bench-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tgis-bench-xla}
mkdir -p "$OUT"
run() {  # name python port VAR=value...
  local name=$1 py=$2 port=$3
  shift 3
  env PJRT_DEVICE=CPU "$@" "$py" -m tgis serve --port "$port" --hostname 127.0.0.1 \
    > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do curl -sf "127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  .venv/bin/tgis benchmark --url "http://127.0.0.1:$port" --profile fixed-length \
    --prompt-tokens 64 --decode-tokens 32 --kind throughput --max-vus 4 --duration 30 \
    --warmup 5 --output "$OUT/bench-$name.json" > "$OUT/bench-$name.log" 2>&1
  kill "$pid"
  wait "$pid" || true
  echo "$name: $(grep -c 'after warmup' "$OUT/serve-$name.log" || true) steps compiled after warmup"
}
run cpu .venv/bin/python 8601 MAX_BATCH_SIZE=4 MAX_TOTAL_TOKENS=512 DTYPE=float32 TGIS_BACKEND=cpu
run tpu-insert .venv-xla/bin/python 8602 HF_BATCH_SIZE=4 HF_SEQUENCE_LENGTH=512 TGIS_BACKEND=tpu
run tpu-rebuild .venv-xla/bin/python 8603 HF_BATCH_SIZE=4 HF_SEQUENCE_LENGTH=512 \
  TGIS_BACKEND=tpu TGIS_PREFILL_MODE=rebuild
.venv/bin/tgis benchmark --compare "$OUT/bench-cpu.json" "$OUT/bench-tpu-insert.json"
