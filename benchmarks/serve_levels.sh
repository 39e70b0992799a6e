#!/usr/bin/env bash
# The serve load test per concurrency level, with the slots sized to the level (slots = clients): for
# each N in $LEVELS, a server
# with N slots on port 8100 (EXTRA: more overrides, e.g. draft=none), the bounded load test of
# benchmarks/load_test.py for $DURATION s, then Ctrl-C (the server drains and logs to MLflow).
#   bash benchmarks/serve_levels.sh NAME [OVERRIDES...]      rows appended to $OUT/serve_levels.log
set -u
name=$1; shift
OUT=${OUT:-outputs/device}; mkdir -p "$OUT"
for n in ${LEVELS:-1 8 32}; do
  python -m pipeline +experiment=serve_eagle3_bcg "$@" serve.max_batch_size=$n serve.port=8100 \
    tracking.run_name=${name}_$n > /tmp/serve_${name}_$n.log 2>&1 &
  pid=$!
  python benchmarks/load_test.py --url http://127.0.0.1:8100 --wait-s 300 --clients $n --duration ${DURATION:-15} \
    --max-tokens 128 --chat --ignore-eos --stream --prompts engine/data/mt_bench/question.jsonl \
    --label "$name N=$n" 2>&1 | tee -a "$OUT/serve_levels.log"
  kill -INT $pid; wait $pid
  grep -E "^\[serve\] stopped" /tmp/serve_${name}_$n.log | cut -c1-220 | tee -a "$OUT/serve_levels.log"
done
