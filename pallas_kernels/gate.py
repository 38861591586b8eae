"""Per-channel log-decay `g` and the write strength `beta` (SPEC §1, Gate): the expressions the
fused kernels share.

Two gate variants, chosen statically by `lower_bound`:
- bounded:   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)),            g in (lb, 0);
- unbounded: g = -exp(A_log[h]) * softplus(f + dt_bias), softplus(u) = u above 20.
and beta = sigmoid(b). No kernel computes the gate alone: the recurrent kernel (decode) and the
diagonal-block kernel of the chunked prefill form it from the raw f and b they load, with these
functions, so both paths evaluate exactly the same expressions. `reference.gate_reference` is
their plain-JAX statement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["gate_math", "beta_math"]

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
