"""gate kernel vs reference.gate_reference, both gate variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels.gate import gate
from pallas_kernels.reference import gate_reference

LEAD, H, K = ((4, 3), 32, 128) if ON_GPU else ((3, 3), 3, 32)
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
GATES = [None, -5.0]


def _inputs(rng, dtype, lead=LEAD):
    kf, kb, ka, kd = jax.random.split(rng, 4)
    # Wide f so the softplus crosses its linear threshold (u > 20) and strong and weak decay mix.
    f = normal(kf, (*lead, H * K), dtype, scale=8.0)
    b = normal(kb, (*lead, H), dtype, scale=2.0)
    a_log = normal(ka, (H,), scale=0.5)
    dt_bias = normal(kd, (H * K,), scale=2.0)
    return f, b, a_log, dt_bias


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("dtype,lead", [(jnp.float32, LEAD), (jnp.bfloat16, (2, 4))])
def test_gate_matches_reference(rng, lower_bound, dtype, lead):
    """An odd row count (one row per program) and a power of two (several rows per program)."""
    args = _inputs(rng, dtype, lead)
    g, beta = gate(*args, head_dim=K, lower_bound=lower_bound)
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


def test_gate_rejects_bad_shapes(rng):
    f, b, a_log, dt_bias = _inputs(rng, jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gate(f[..., :-1], b, a_log, dt_bias, head_dim=K, lower_bound=None)
    with pytest.raises(ValueError, match="b has shape"):
        gate(f, b[..., :-1], a_log, dt_bias, head_dim=K, lower_bound=None)


@pytest.mark.parametrize("lower_bound", GATES)
def test_gate_lowers_for_h200(lower_bound):
    f = jnp.ones((2, 4, 32 * 128), jnp.bfloat16)
    b = jnp.ones((2, 4, 32), jnp.bfloat16)
    a_log, dt_bias = jnp.ones((32,)), jnp.ones((32 * 128,))
    text = lower_for_h200(
        lambda *a: gate(*a, head_dim=128, lower_bound=lower_bound), f, b, a_log, dt_bias
    )
    assert "kda_gate" in text
