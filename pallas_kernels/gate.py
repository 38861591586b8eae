"""Per-channel log-decay `g` and the write strength `beta` (SPEC §1, Gate).

Two gate variants, chosen statically by `lower_bound`:
- bounded:   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)),            g in (lb, 0);
- unbounded: g = -exp(A_log[h]) * softplus(f + dt_bias), softplus(u) = u above 20.
and beta = sigmoid(b). The elementwise math lives in `gate_math` / `beta_math` so the recurrent
kernel, which fuses the gate into the decode step, computes exactly the same expressions.

Layout: the N = prod(lead) rows of f [N, P] are tiled as [block_rows, K] per (row tile, head);
each program also writes beta for its rows and head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

__all__ = ["GateBlockSizes", "gate", "gate_math", "beta_math"]

f32 = jnp.float32
SOFTPLUS_LINEAR_ABOVE = 20.0


def gate_math(u: jax.Array, a: jax.Array, lower_bound: float | None) -> jax.Array:
    """g from u = f + dt_bias (fp32) and a = exp(A_log[h]) (fp32, broadcastable)."""
    if lower_bound is None:
        soft = jnp.log1p(jnp.exp(jnp.minimum(u, SOFTPLUS_LINEAR_ABOVE)))
        return -a * jnp.where(u > SOFTPLUS_LINEAR_ABOVE, u, soft)
    return lower_bound * jax.nn.sigmoid(a * u)


def beta_math(b: jax.Array) -> jax.Array:
    """beta = sigmoid(b), fp32."""
    return jax.nn.sigmoid(b.astype(f32))


@dataclasses.dataclass(frozen=True)
class GateBlockSizes:
    """Tiling of `gate`.

    Attributes:
      block_rows: rows per program, a power of two dividing the row count N.
      num_warps: Triton warps per program.
    """

    block_rows: int
    num_warps: int = 4

    @staticmethod
    def default_for(n_rows: int, k: int) -> GateBlockSizes:
        """About 4K channels per program: the largest power of two dividing n_rows, capped."""
        cap = max(1, 4096 // k)
        return GateBlockSizes(block_rows=min(cap, n_rows & -n_rows))


def _gate_kernel(f_ref, b_ref, a_log_ref, dt_ref, g_ref, beta_ref, *, lower_bound):
    """f_ref, g_ref: [block_rows, K]; b_ref, beta_ref: [block_rows]; a_log_ref: [1];
    dt_ref: [K]."""
    a = jnp.exp(a_log_ref[...].astype(f32))  # [1]
    u = f_ref[...].astype(f32) + dt_ref[...].astype(f32)[None, :]
    g_ref[...] = gate_math(u, a[:, None], lower_bound)
    beta_ref[...] = beta_math(b_ref[...])


def gate(
    f: jax.Array,
    b: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    head_dim: int,
    lower_bound: float | None,
) -> tuple[jax.Array, jax.Array]:
    """Log-decay and beta; the kernel of `reference.gate_reference`.

    Args:
      f: [..., P] forget-gate input f_b(f_a(x)), any float dtype (P = H * head_dim).
      b: [..., H] beta logits, any float dtype.
      a_log: [H] fp32; dt_bias: [P] fp32.
      head_dim: K, a power of two.
      lower_bound: lb of the bounded gate, or None for the unbounded gate.
    Returns:
      g: [..., H, K] fp32; beta: [..., H] fp32.
    """
    h = a_log.shape[-1]
    k = head_dim
    *lead, p = f.shape
    if a_log.shape != (h,) or p != h * k or tuple(dt_bias.shape) != (p,):
        raise ValueError(
            f"gate: f {f.shape}, a_log {a_log.shape}, dt_bias {dt_bias.shape} do not fit "
            f"H={h}, head_dim={k}: expected f [..., H*K], a_log [H], dt_bias [H*K]"
        )
    if tuple(b.shape) != (*lead, h):
        raise ValueError(f"gate: b has shape {tuple(b.shape)}, expected {(*lead, h)}")
    if k & (k - 1):
        raise ValueError(f"gate: head_dim={k} must be a power of two")
    n = math.prod(lead)
    if n == 0:
        return jnp.zeros((*lead, h, k), f32), jnp.zeros((*lead, h), f32)
    blk = GateBlockSizes.default_for(n, k)
    rows_spec = pl.BlockSpec((blk.block_rows, None, k), lambda i, j: (i, j, 0))
    g, beta = pl.pallas_call(
        functools.partial(_gate_kernel, lower_bound=lower_bound),
        out_shape=(
            jax.ShapeDtypeStruct((n, h, k), f32),
            jax.ShapeDtypeStruct((n, h), f32),
        ),
        grid=(n // blk.block_rows, h),
        in_specs=[
            rows_spec,
            pl.BlockSpec((blk.block_rows, None), lambda i, j: (i, j)),
            pl.BlockSpec((1,), lambda i, j: (j,)),
            pl.BlockSpec((None, k), lambda i, j: (j, 0)),
        ],
        out_specs=(rows_spec, pl.BlockSpec((blk.block_rows, None), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=1),
        name="kda_gate",
        interpret=common.interpret(),
    )(f.reshape(n, h, k), b.reshape(n, h), a_log, dt_bias.reshape(h, k))
    return g.reshape(*lead, h, k), beta.reshape(*lead, h)
