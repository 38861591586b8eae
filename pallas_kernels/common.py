"""Helpers shared by the kernel files: interpret-mode selection and power-of-two sizing."""

from __future__ import annotations

import os

import jax

__all__ = ["interpret", "next_pow2", "cdiv"]


def interpret() -> bool:
    """True when kernels must run in Pallas interpret mode.

    Compiled kernels need a GPU; on any other platform they run interpreted (slow, for tests).
    `KDA_PALLAS_INTERPRET=1` forces interpret mode on a GPU too (debugging).
    """
    if os.environ.get("KDA_PALLAS_INTERPRET", "") == "1":
        return True
    return jax.default_backend() != "gpu"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
