#!/usr/bin/env bash
# EAGLE3 training experiments (issue 5), in the background, read with `device.sh poll`:
#   bash benchmarks/e3_lab.sh bench             the training kernels' GPU tests, then the training step phase by
#                                               phase (benchmarks/train_step.py) with the Triton kernels, the
#                                               Triton loss only and none, then a kernel profile
#   bash benchmarks/e3_lab.sh data              the self-distilled samples only (NUM samples, generation batch DB)
#   bash benchmarks/e3_lab.sh train NAME ...    train_eagle3_smollm2 on those samples (overrides after NAME),
#                                               then the head's evals (below)
#   bash benchmarks/e3_lab.sh pair "A..." "B..." on two GPUs: the data once (and the step benchmark on GPU 1
#                                               meanwhile), then two trainings side by side
#                                               (overrides A on GPU 0 as e3a, B on GPU 1 as e3b), each with its
#                                               evals, then the GPU tests on GPU 1
#   bash benchmarks/e3_lab.sh evals NAME [GPU]  the evals below again for outputs/train/NAME/head (NAME_again_*.log)
#   bash benchmarks/e3_lab.sh duo "A..." "B..." ["C..." ...]  one GPU per override set: the whole experiment
#                                               side by side, each one job (its own data, then training: the
#                                               issue's 15-minute budget is this job's wall time), A on GPU 0
#                                               as e3a, B on GPU 1 as e3b, C on GPU 2 as e3c, ..., each with
#                                               its evals, then the GPU tests on GPU 1
#   bash benchmarks/e3_lab.sh share "A..." "B..." [...]  one GPU for all: the data once, then the trainings
#                                               side by side on GPU 0 (e3a, e3b, ...; each its own MLflow
#                                               store), each with its evals, then the GPU tests. The recipe's
#                                               step leaves the GPU idle half the time (host-bound), so two
#                                               trainings share it at a modest cost in steps; for override
#                                               sets that leave the data alone (the data is read from cache)
#                                               (DATA_OVR="passages=tasks ...": data overrides for the data
#                                               job and every training alike)
# Evals of a head: MT-bench (80) under full graphs, GSM8K / HumanEval / Alpaca (40 each) under full graphs,
# MT-bench (10) eagerly; every one against the no-draft baseline of the same job, k = 5, greedy.
# EVALS=mt: MT-bench only (the others later with `EVALS=rest ... evals NAME`, to spare device time:
# rest skips the MT-bench a head already has; a head's MT-bench is deterministic).
# Every job has its own Hydra run dir and a per-GPU MLflow store under /tmp/bg; each appends to /tmp/bg/done.
set -u
. benchmarks/jobs.sh
DATA=""  # the recipe's own data settings, unless NUM (samples), DB (generation batch) or DATA_OVR are given
[ -n "${NUM:-}" ] && DATA="$DATA train.data.num_samples=$NUM"
[ -n "${DB:-}" ] && DATA="$DATA train.data.batch_size=$DB"
[ -n "${DATA_OVR:-}" ] && DATA="$DATA $DATA_OVR"  # other data overrides (e.g. passages=tasks), for share

train_and_eval() {  # train_and_eval GPU NAME OVERRIDES... (DATA: the data overrides; duo clears them)
  local gpu=$1 name=$2; shift 2
  job $gpu $name +experiment=train_eagle3_smollm2 $DATA train.name=$name "$@"
  head_evals $gpu $name $name
}

head_evals() {  # head_evals GPU NAME PREFIX: the evals of outputs/train/NAME/head, logs PREFIX_*.log
  local gpu=$1 p=$3 head="draft.init=checkpoint draft.path=outputs/train/$2/head"
  [ "${EVALS:-all}" != rest ] && job $gpu ${p}_mt +experiment=eagle3_full eval=mt_bench $head
  # train.ema_decay: the last step's own weights too (head_last), on MT-bench: the pair from one run
  [ "${EVALS:-all}" != rest ] && [ -d outputs/train/$2/head_last ] && \
    job $gpu ${p}_last_mt +experiment=eagle3_full eval=mt_bench draft.init=checkpoint draft.path=outputs/train/$2/head_last
  [ "${EVALS:-all}" = mt ] && return  # EVALS=mt: MT-bench only (the rest later, with EVALS=rest `evals NAME`)
  for ds in gsm8k humaneval alpaca; do job $gpu ${p}_$ds +experiment=eagle3_full eval.dataset=$ds eval.limit=40 $head; done
  job $gpu ${p}_none +experiment=eagle3 eval=mt_bench eval.limit=10 $head
}

datagen() {  # the samples once on GPU 0 (one training step), cached for the trainings that follow
  job 0 data +experiment=train_eagle3_smollm2 $DATA train.name=datagen train.steps=1 train.loop_eval_prompts=0
}

side_by_side() {  # side_by_side "A..." "B..." ...: set i on GPU i as e3a, e3b, ... (the GPU tests after e3b)
  local i=0 letters=abcdefgh  # ONE_GPU=1: every set on GPU 0 (store i each), the GPU tests after all
  for o in "$@"; do
    local gpu=$([ -n "${ONE_GPU:-}" ] && echo 0 || echo $i)
    # shellcheck disable=SC2086
    (export STORE=$i; train_and_eval $gpu e3${letters:$i:1} $o
     if [ $i = 1 ] && [ -z "${ONE_GPU:-}" ]; then gpu_tests 1; fi) &
    i=$((i + 1))
  done
  wait
  if [ -n "${ONE_GPU:-}" ]; then gpu_tests 0; fi
  echo "all done $(date +%T)" >> $L/done
}

gpu_tests() {  # gpu_tests GPU
  CUDA_VISIBLE_DEVICES=$1 python -m pytest -q -p no:cacheprovider -m "not slow" tests/test_train_draft.py \
    tests/test_kernels.py tests/test_graphs.py tests/test_gpu.py tests/test_multi_layer.py tests/test_dflash.py \
    > $L/tests.log 2>&1
  echo "tests exit $? $(date +%T)" >> $L/done
}

case "$1" in
bench)  # the kernels' GPU tests, then the step with each kernel set (train_step.py's variants), profiled
  python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_train_draft.py tests/test_train_data.py \
    -k "soft or rms or rope or ops or kernel or ttt or target_batch or fused_model" > $L/kernel_tests.log 2>&1
  echo "kernel tests exit $? $(date +%T)" >> $L/done
  TORCH_LOGS=recompiles python benchmarks/train_step.py --profile --variants flex,flex_fused_loss,flex_torch_kernels \
    --shapes 32x512,64x256,40x400 > $L/train_step.log 2>&1
  echo "bench exit $? $(date +%T)" >> $L/done ;;
data)
  datagen ;;
train)
  name=$2; shift 2
  train_and_eval 0 $name "$@" ;;
evals)  # evals NAME [GPU]: a trained head's evals again, alone (logs NAME_again_*), e.g. once the others are done
  head_evals "${3:-0}" "$2" "$2_again"
  echo "evals done $(date +%T)" >> $L/done ;;
pair)
  a=$2 b=$3
  (CUDA_VISIBLE_DEVICES=1 python benchmarks/train_step.py --variants eager,flex --shapes 32x512,64x256 \
     > $L/train_step.log 2>&1; echo "bench exit $? $(date +%T)" >> $L/done) &
  datagen
  wait  # the step benchmark on GPU 1 ends before its training starts
  side_by_side "$a" "$b" ;;
share)  # one GPU: the data once, then the trainings side by side on it
  datagen
  shift; ONE_GPU=1 side_by_side "$@" ;;
duo)
  DATA=""  # the recipe's own data settings unless an override set changes them (not NUM / DB)
  shift; side_by_side "$@" ;;
*) echo "unknown phase $1"; exit 2 ;;
esac
