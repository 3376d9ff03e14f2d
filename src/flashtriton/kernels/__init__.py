"""Triton kernels (forward.py, backward.py), their shared helpers and the launch-config table."""
