"""The Flax NNX module over the functional core."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ON_GPU, TOL, assert_close, normal
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
    kw = dict(backend="xla", precision=blk.precision)  # the module's ("default": TF32 on a GPU)
    y_f, s_f = K.prefill(p, cfg, x, s0, **kw)
    np.testing.assert_array_equal(y, y_f)
    yd, sd = blk.decode(x[:, 0], s)
    yd_f, _ = K.decode(p, cfg, x[:, 0], s_f, **kw)
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
    biased = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), gate_bias=True)
    assert nnx.get_partition_spec(nnx.state(biased, nnx.Param))["g_bias"].get_value() == P("model")


def test_param_dtype_defaults_to_dtype():
    """Without param_dtype the matrices are stored as they compute: no cast on any call."""
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert blk.param_dtype == blk.dtype == jnp.bfloat16 and blk.params().dtype == jnp.bfloat16


def test_bf16_compute_over_fp32_params_meets_the_bf16_bar_with_fp32_gradients(rng):
    """Flax's convention: parameters in param_dtype, computation in dtype."""
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(
        cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.bfloat16, param_dtype=jnp.float32
    )
    assert blk.param_dtype == jnp.float32 and blk.dtype == jnp.bfloat16
    params = nnx.state(blk, nnx.Param)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    x = normal(rng, (2, 19, cfg.hidden))
    y, s = blk(x)
    assert y.dtype == jnp.bfloat16
    y_ref, s_ref, _ = K.oracle_forward(blk.params(), cfg, x, blk.init_state(2))
    assert_close(y, y_ref, TOL["bf16_e2e"], "y")
    assert_close(s.recurrent, s_ref.recurrent, TOL["bf16_e2e"], "state")

    def loss(m):
        y, _ = m(x)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    grads = jax.tree.leaves(nnx.state(nnx.grad(loss)(blk), nnx.Param))
    assert {g.dtype for g in grads} == {jnp.dtype(jnp.float32)}
    assert all(np.isfinite(g).all() for g in grads) and any(np.abs(g).max() > 0 for g in grads)


def test_param_dtype_bf16_stores_matrices_in_bf16_and_vectors_in_fp32():
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, gate_bias=True)
    p = blk.params()
    assert p.dtype == jnp.bfloat16 and p.o_proj.dtype == jnp.bfloat16
    assert p.a_log.dtype == p.g_bias.dtype == jnp.float32 and p.g_bias.shape == (cfg.qkv_dim,)


def test_default_precision_keeps_the_fp32_bar(rng):
    cfg = K.preset("tiny-bounded")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    x = normal(rng, (2, 21, cfg.hidden))
    y, s = blk(x)
    y_ref, s_ref, _ = K.oracle_forward(blk.params(), cfg, x, blk.init_state(2))
    bar = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]  # "default" is TF32 on a GPU
    assert_close(y, y_ref, bar, "y")
    assert_close(s.recurrent, s_ref.recurrent, bar, "state")
    with pytest.raises(ValueError, match="precision='ultra'"):
        K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), precision="ultra")


def test_weight_decay_mask_leaves_out_the_gate_norm_and_bias():
    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, gate_bias=True)
    mask = K.weight_decay_mask(nnx.state(blk, nnx.Param))
    flat = {str(path[0].key): m for path, m in jax.tree_util.tree_leaves_with_path(mask)}
    assert {n for n, m in flat.items() if not m} == {"a_log", "dt_bias", "o_norm_w", "g_bias"}
    assert {n for n, m in flat.items() if m} == {"w_in", "f_b", "g_b", "conv_w", "o_proj"}
    tx = optax.adamw(1e-3, weight_decay=0.1, mask=K.weight_decay_mask)
    opt = nnx.Optimizer(blk, tx, wrt=nnx.Param)
    zero = jax.tree.map(jnp.zeros_like, nnx.state(blk, nnx.Param))
    before = blk.params()
    opt.update(blk, zero)  # zero gradients: only weight decay moves a parameter
    after = blk.params()
    for name in ("a_log", "dt_bias", "o_norm_w", "g_bias"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name))
    assert not np.array_equal(after.w_in, before.w_in)
