"""Factory: an RL post-training experiment factory, the engine under the Dagster layer.

Plain Python: only `factory.deploy` imports dagster and dagster-k8s (the step executor and the Jobs
dagster-k8s builds), and the RL run's Pipes entry point imports dagster-pipes."""

__version__ = "0.1.0"
