"""One training run's lifecycle: the experiment's stages (dataset, SFT warm start, the control, the eval report),
the RL run (`Run`: one attempt from begin to finish or fail, recorded in the lake and MLflow), its attempts and
their restarts, the record of interruptions, the Dagster Pipes entrypoint, evaluating recorded checkpoints, and
the exit codes all of these share with the command line."""
