"""Helpers shared by the kernel files: interpret-mode selection, the in-kernel barrier, part
bounds, power-of-two sizing and the prefill's per-token output mask."""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

__all__ = [
    "TARGET_PROGRAMS",
    "resolve_interpret",
    "hopper",
    "barrier",
    "bounds",
    "next_pow2",
    "cdiv",
    "output_keep",
]

# Two programs per SM of the H200 (132 SMs): the fill that the decode kernels' tilings aim for.
TARGET_PROGRAMS = 2 * 132


def resolve_interpret(interpret: bool | None) -> bool:
    """The `interpret` argument of a public kernel: True or False as given; None picks interpret
    mode when there is no GPU (compiled kernels need one; interpreted ones are slow, for tests)
    or when `KDA_PALLAS_INTERPRET=1` (debugging on a GPU)."""
    if interpret is not None:
        return bool(interpret)
    if os.environ.get("KDA_PALLAS_INTERPRET", "") == "1":
        return True
    return jax.default_backend() != "gpu"


def hopper() -> bool:
    """True when the kernels are built for sm_90 or newer (the Mosaic GPU kernels need TMA and
    wgmma): on a GPU, by its compute capability; elsewhere (interpret mode, cross-lowering for
    the H200) always, so a CPU runs the kernels an H200 runs."""
    if jax.default_backend() != "gpu":
        return True
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return major.isdigit() and int(major) >= 9  # "gfx..." (ROCm) is not Hopper either


def barrier(interpret: bool) -> None:
    """__syncthreads inside a Triton kernel: orders one program's stores before its other
    threads' loads of the same addresses. Interpret mode runs a program in order: nothing."""
    if not interpret:
        plt.debug_barrier()


def bounds(widths) -> tuple[int, ...]:
    """(0, w0, w0 + w1, ..., sum): where consecutive parts of the given widths start and end."""
    return (0, *itertools.accumulate(int(w) for w in widths))


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def output_keep(lengths: jax.Array, t: int, poison: jax.Array | None = None) -> jax.Array:
    """[B, T] fp32 for `o_norm`'s keep: 1 below lengths, NaN from lengths to `poison` ([B],
    the row's real length when a non-finite token cut `lengths` short), 0 at the pads."""
    pos = jnp.arange(t)[None, :]
    keep = (pos < lengths[:, None]).astype(jnp.float32)
    if poison is None:
        return keep
    return jnp.where((pos >= lengths[:, None]) & (pos < poison[:, None]), jnp.nan, keep)
