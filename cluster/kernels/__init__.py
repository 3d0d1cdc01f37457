"""Device kernels this project supplies where MLX or mlx-lm lacks one for a backend.

A kernel changes how a model computes, so each has a VERSION that enters the fingerprint of the blocks it
made (kvcache/setup.py::kernels_in_effect)."""
