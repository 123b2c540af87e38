"""Kubernetes deployment of Factory: a deploy profile (`profile.py`), the manifests a spec needs (`manifests.py`),
writing them for review or GitOps (`render.py`, `factory deploy render`), the code location's profile switch
(`target.py`, FACTORY_PROFILE=k8s), launching a GRPO run's objects on a cluster (`cluster.py`) and preflight Jobs
per node (`preflight.py`).

The one package of `factory` that imports dagster and dagster-k8s (`target.py`, `manifests.py`). The manifests are
checked against the published schemas of a Kubernetes release, and `cluster.py` runs in the tests against a fake API
server (tests/deploy/fake_kube.py); docs/kubernetes.md says what has not run on a real cluster.
"""
