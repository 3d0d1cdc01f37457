"""Ray Serve deployments (Gateway, ModelReplica) and per-node actors."""

from cluster.actors import loopback as _loopback

_loopback.apply()
