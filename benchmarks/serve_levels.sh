#!/usr/bin/env bash
# The server with and without its draft, per concurrency level and temperature, in one run; then the ratio
# table (draft / no draft tokens/s per level and temperature). For each N in $LEVELS: a server with N slots
# (slots = clients) on port $PORT, `+experiment=serve_eagle3_bcg` plus OVERRIDES, then the same with
# draft=none; against each, the bounded load test of benchmarks/load_test.py (N streaming chat clients,
# MT-bench, 128 tokens, $DURATION s) at every temperature in $TEMPS (0: greedy; 1.0: the request default,
# serve.default_temperature); then Ctrl-C (the server drains and logs to MLflow).
#   bash benchmarks/serve_levels.sh NAME [OVERRIDES...]
#   LEVELS="1 8 32 64" TEMPS="0 1.0" DURATION=15 WARMUP=3 OUT=outputs/device PYTHON=python3 PORT=8100 (the defaults)
# Rows go to $OUT/serve_levels/NAME/{draft,none}_n<N>_t<T>.json with each server's log beside them
# (server_{draft,none}_n<N>.log: runs side by side on one host, under other NAMEs or OUTs, keep theirs
# apart), and the tables to $OUT/serve_levels.log; the ratio table covers every level in that folder, so
# a run split over calls (LEVELS="1 8", then "32 64") ends with the whole table. Needs only what the
# server needs, and httpx (the offline GPU host's wheels).
set -u
name=$1; shift
py=${PYTHON:-python3}; port=${PORT:-8100}
OUT=${OUT:-outputs/device}; dir=$OUT/serve_levels/$name; mkdir -p "$dir"
for n in ${LEVELS:-1 8 32 64}; do
  for side in draft none; do
    baseline=""; [ "$side" = none ] && baseline=draft=none  # last: it wins over a draft in OVERRIDES
    $py -m pipeline +experiment=serve_eagle3_bcg "$@" $baseline serve.max_batch_size=$n serve.port=$port \
      tracking.run_name=${name}_${side}_$n > "$dir/server_${side}_n$n.log" 2>&1 &
    pid=$!
    for t in ${TEMPS:-0 1.0}; do  # an untimed pass first: the level's own first seconds are not its speed
      $py benchmarks/load_test.py --url http://127.0.0.1:$port --wait-s 600 --clients $n --duration ${WARMUP:-3} \
        --max-tokens 128 --chat --ignore-eos --stream --temperature $t --prompts engine/data/mt_bench/question.jsonl \
        > /dev/null 2>&1
      $py benchmarks/load_test.py --url http://127.0.0.1:$port --wait-s 600 --clients $n \
        --duration ${DURATION:-15} --max-tokens 128 --chat --ignore-eos --stream --temperature $t \
        --prompts engine/data/mt_bench/question.jsonl --json "$dir/${side}_n${n}_t${t}.json" \
        --label "$name $side N=$n T=$t" 2>&1 | tee -a "$OUT/serve_levels.log"
    done
    kill -INT $pid; wait $pid
    grep -A10 -E "^\[serve\] (adaptive k|stopped)" "$dir/server_${side}_n$n.log" | cut -c1-300 | tee -a "$OUT/serve_levels.log"
  done
done
echo "$name: draft / no draft" | tee -a "$OUT/serve_levels.log"
$py benchmarks/load_test.py --ratios "$dir" | tee -a "$OUT/serve_levels.log"
