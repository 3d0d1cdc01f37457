"""Load tests for an mlx-fleet (or any OpenAI-compatible) endpoint: locust users with seeded, cache-aware
workloads (locustfile.py), and a runner that starts or attaches to a fleet, compares routing policies, and
writes locust's CSV/HTML, a summary JSON and plots (run.py, `mlx-fleet loadtest`)."""
