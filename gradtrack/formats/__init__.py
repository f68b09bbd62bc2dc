"""What gradtrack writes into a tracker, named in one place: its sinks write it, its readers
(`gradtrack.report`) read it back.

`keys` names metrics, `metrics` turns a step into them, `wandb` and `mlflow` hold each
tracker's own names (and MLflow's artifact readers), `histogram_store` the histogram files.
Nothing here imports a sink or the report package.
"""
