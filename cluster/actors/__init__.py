"""Ray Serve deployments (Gateway, ModelReplica), the request router, and per-node actors."""
