"""gate_math / beta_math, the expressions the fused kernels share, vs reference.gate_reference,
both gate variants."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, normal

from pallas_kernels.gate import beta_math, gate_math
from pallas_kernels.reference import gate_reference

LEAD, H, K = ((4, 3), 32, 128) if ON_GPU else ((3, 3), 3, 32)
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
GATES = [None, -5.0]


def _inputs(rng, dtype, lead=LEAD):
    kf, kb, ka, kd = jax.random.split(rng, 4)
    # Wide f so the softplus crosses its linear threshold (u > 20) and strong and weak decay mix;
    # one channel per row pinned far past it, so every draw covers both branches.
    f = normal(kf, (*lead, H * K), dtype, scale=8.0).at[..., 0].set(60.0)
    b = normal(kb, (*lead, H), dtype, scale=2.0)
    a_log = normal(ka, (H,), scale=0.5)
    dt_bias = normal(kd, (H * K,), scale=2.0)
    return f, b, a_log, dt_bias


@functools.partial(jax.jit, static_argnames=("head_dim", "lower_bound"))
def _gate(f, b, a_log, dt_bias, *, head_dim, lower_bound):
    """g and beta as the kernels form them: u = f + dt_bias per head, a = exp(A_log[h])."""
    u = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    u = u.reshape(*u.shape[:-1], a_log.shape[0], head_dim)
    a = jnp.exp(a_log.astype(jnp.float32))[:, None]
    return gate_math(u, a, lower_bound), beta_math(b)


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("dtype,lead", [(jnp.float32, LEAD), (jnp.bfloat16, (2, 4))])
def test_gate_matches_reference(rng, lower_bound, dtype, lead):
    args = _inputs(rng, dtype, lead)
    g, beta = _gate(*args, head_dim=K, lower_bound=lower_bound)
    g_ref, beta_ref = gate_reference(*args, head_dim=K, lower_bound=lower_bound)
    assert g.shape == (*lead, H, K) and g.dtype == jnp.float32
    assert beta.shape == (*lead, H) and beta.dtype == jnp.float32
    u = np.asarray(args[0], np.float32) + np.asarray(args[3])
    if lower_bound is None:
        assert (u > 20).any() and (u < 20).any(), "inputs must cover both softplus branches"
    # g < 0 mathematically; the bounded gate's sigmoid of a very negative argument is
    # subnormal and flushes to zero on a GPU, so exactly 0 (no decay) is a legal result.
    assert np.all(np.asarray(g) <= 0) and np.all(np.isfinite(g))
    assert_close(g, g_ref, FP32_TOL, "g")
    assert_close(beta, beta_ref, FP32_TOL, "beta")
