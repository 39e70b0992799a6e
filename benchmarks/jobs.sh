# Sourced by the background GPU scripts (par.sh, e3_lab.sh): one pipeline job per call, its own Hydra run
# dir and a per-GPU MLflow store under $L (STORE=N: store N instead, for jobs that share a GPU), its log
# in $L/NAME.log, and "NAME exit RC TIME" in $L/done.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=${L:-/tmp/bg}
mkdir -p "$L"

job() {  # job GPU NAME OVERRIDES...
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu python -m pipeline "$@" tracking.run_name=$name \
    tracking.tracking_uri=sqlite:///$L/mlflow${STORE:-$gpu}.db hydra.run.dir=$L/runs/$name > $L/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $L/done
}
