"""The runner: config schema, plan (resolve + validate), execution, MLflow tracking, comparison."""
