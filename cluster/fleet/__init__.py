"""The local fleet: Redis, Ray nodes and the Serve app on one machine (`mlx-fleet up`)."""
