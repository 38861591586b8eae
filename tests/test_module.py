"""The Flax NNX module over the functional core."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kda_jax as K


def test_module_methods_equal_functional_core():
    cfg = K.preset("tiny-bounded")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    assert blk.cfg == cfg and blk.backend == "xla"
    p = blk.params()
    p.check(cfg)
    x = jax.random.normal(jax.random.key(1), (2, 11, cfg.hidden))
    s0 = blk.init_state(2)
    y, s = blk(x)
    y_f, s_f = K.prefill(p, cfg, x, s0, backend="xla")
    np.testing.assert_array_equal(y, y_f)
    yd, sd = blk.decode(x[:, 0], s)
    yd_f, _ = K.decode(p, cfg, x[:, 0], s_f, backend="xla")
    np.testing.assert_array_equal(yd, yd_f)
    yk, sk, snaps = blk.decode_k(x[:, :3], sd)
    assert yk.shape == (2, 3, cfg.hidden) and snaps.recurrent.shape[:2] == (2, 3)
    y_len, _ = blk.prefill(x, s0, jnp.array([11, 4]))
    np.testing.assert_array_equal(y_len[0], y[0])


@pytest.mark.slow
def test_module_params_are_nnx_state_and_trainable():
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    params = nnx.state(blk, nnx.Param)
    assert len(jax.tree.leaves(params)) == 8
    x = jax.random.normal(jax.random.key(2), (1, 20, cfg.hidden))

    def loss(m):
        y, _ = m(x)
        return jnp.mean(y**2)

    grads = nnx.grad(loss)(blk)
    g = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.all(np.isfinite(a)) for a in g) and any(float(jnp.abs(a).max()) > 0 for a in g)


def test_nnx_jit_decode_loop_compiles_once():
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla")
    traces = []

    @nnx.jit
    def generate(m, state, xs):
        traces.append(1)

        def body(i, s):
            _, s = m.decode(xs[:, i], s)
            return s

        return jax.lax.fori_loop(0, xs.shape[1], body, state)

    s = blk.init_state(2)
    for seed in range(3):
        xs = jax.random.normal(jax.random.key(seed), (2, 6, cfg.hidden), jnp.bfloat16)
        s = generate(blk, s, xs)
    assert len(traces) == 1
    assert np.all(np.isfinite(s.recurrent))


def test_module_params_carry_partition_specs():
    """nnx.get_partition_spec gives the head split of kda_jax.sharding.PARAM_AXES; the fused w_in
    and conv_w (q | k | v interleave across any row split) stay whole."""
    from jax.sharding import PartitionSpec as P

    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    specs = nnx.get_partition_spec(nnx.state(blk, nnx.Param))
    got = {name: specs[name].get_value() for name in ("w_in", "f_b", "a_log", "o_norm_w", "o_proj")}
    assert got == dict(
        w_in=P(None, None),
        f_b=P("model", None),
        a_log=P("model"),
        o_norm_w=P(None),
        o_proj=P(None, "model"),
    )
    loaded = K.KimiDeltaAttention.from_params(cfg, blk.params(), backend="xla")
    assert nnx.get_partition_spec(nnx.state(loaded, nnx.Param))["dt_bias"].get_value() == P("model")
