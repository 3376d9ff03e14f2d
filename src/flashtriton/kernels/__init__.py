"""Triton kernels (forward.py, backward.py, decode.py), their shared helpers and the launch-config table."""
