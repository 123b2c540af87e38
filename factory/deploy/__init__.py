"""Kubernetes deployment of Factory: a deploy profile (`profile.py`), the manifests a spec needs (`manifests.py`),
writing them for review or GitOps (`render.py`, `factory deploy render`), the code location's profile switch
(`target.py`, FACTORY_PROFILE=k8s), launching a GRPO run's objects on a cluster (`cluster.py`) and preflight Jobs
per node (`preflight.py`).

No Kubernetes API server can run where this was written: the manifests are checked against the published schemas
of a Kubernetes release, and `cluster.py` was run only against a fake API server (tests/deploy/fake_kube.py).
"""
