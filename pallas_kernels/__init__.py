"""Pallas (Triton backend) GPU kernels of the KDA block, each with a pure-jnp reference.

Kernels run compiled on an NVIDIA GPU and in interpret mode elsewhere (see `common.interpret`).
"""
