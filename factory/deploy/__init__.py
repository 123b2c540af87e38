"""Kubernetes deployment of Factory: a deploy profile (`profile.py`), the manifests a spec needs (`manifests.py`),
and writing them for review or GitOps (`render.py`, `factory deploy render`).

Nothing here talks to a Kubernetes API server: the manifests are checked against the published schemas of a
Kubernetes release (tests/deploy), never applied to a cluster.
"""
