"""No silent wrong answers: hostile inputs get the right result or one clear error, early.

Each test pins one edge: non-finite padding and tokens (values and gradients), snapshot indices,
configs, the pallas backend's envelope, empty batches and sequences, numpy integer scalars.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, block_setup

import kda_jax as K

FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]  # TF32 dots on a GPU

GATES = ["tiny", "tiny-bounded"]
BACKENDS = ["xla", "pallas"]


_block = block_setup


def _all_finite(tree) -> bool:
    return all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("name", GATES)
def test_nonfinite_pads_give_finite_gradients(name, poison, rng):
    """The xla path's backward ignores pads as its forward does: every gradient is finite, the
    pads' own gradient is exactly zero, and it equals the gradient with clean pads."""
    cfg, p, s0, key = _block(name, rng)
    x = jax.random.normal(key, (2, 40, cfg.hidden))
    lengths = jnp.array([40, 23])

    def loss(p, x, s):
        y, st = K.prefill(p, cfg, x, s, lengths, backend="xla")
        return jnp.sum(y**2) + jnp.sum(st.recurrent**2) + jnp.sum(st.conv**2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    clean = grad(p, x, s0)
    dirty = grad(p, x.at[1, 23:].set(poison), s0)
    assert _all_finite(dirty)
    np.testing.assert_array_equal(dirty[1][1, 23:], 0.0)
    for got, want in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
        assert_close(got, want, FP32_TOL, "grad with poisoned pads")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("name", GATES)
def test_nonfinite_token_stays_causal_and_in_its_row(name, poison, backend, rng):
    """A non-finite real token (mid-chunk, one channel of x) leaves every earlier output of its
    row and every other row as they were; its row is NaN from that token on, state included."""
    cfg, p, s0, key = _block(name, rng)
    t, bad = 50, 20  # chunk 16: token 20 sits inside the second chunk
    x = jax.random.normal(key, (2, t, cfg.hidden))
    y_ref, s_ref = K.prefill(p, cfg, x, s0, backend=backend)
    y, s = K.prefill(p, cfg, x.at[0, bad, 7].set(poison), s0, backend=backend)
    np.testing.assert_array_equal(y[1], y_ref[1])
    np.testing.assert_array_equal(s.recurrent[1], s_ref.recurrent[1])
    np.testing.assert_array_equal(s.conv[1], s_ref.conv[1])
    assert_close(y[0, :bad], y_ref[0, :bad], FP32_TOL, "outputs before the bad token")
    assert bool(jnp.isnan(y[0, bad:]).all())
    assert bool(jnp.isnan(s.recurrent[0]).all()) and bool(jnp.isnan(s.conv[0]).all())


def test_nonfinite_token_gradients_stay_causal(rng):
    """Gradients of outputs before a NaN token are finite and equal the clean input's."""
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 40, cfg.hidden))

    def loss(p, x):
        y, _ = K.prefill(p, cfg, x, s0, backend="xla")
        return jnp.sum(y[:, :20] ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    clean = grad(p, x)
    dirty = grad(p, x.at[0, 21].set(jnp.nan))
    assert _all_finite(dirty)
    for got, want in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
        assert_close(got, want, FP32_TOL, "grad of outputs before the NaN")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_row_of_decode_k_stays_causal(backend, rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 4, cfg.hidden))
    y_ref, _, snaps_ref = K.decode_k(p, cfg, x, s0, backend=backend)
    y, _, snaps = K.decode_k(p, cfg, x.at[0, 2].set(jnp.nan), s0, backend=backend)
    np.testing.assert_array_equal(y[0, :2], y_ref[0, :2])
    np.testing.assert_array_equal(y[1], y_ref[1])
    np.testing.assert_array_equal(snaps.recurrent[:, :2], snaps_ref.recurrent[:, :2])
    assert bool(jnp.isnan(y[0, 2:]).all()) and bool(jnp.isnan(snaps.recurrent[0, 2:]).all())


def test_select_snapshot_checks_its_index(rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 3, cfg.hidden))
    _, _, snaps = K.decode_k(p, cfg, x, s0, backend="xla")
    with pytest.raises(ValueError, match=r"values \[-1\] outside \[0, 3\).*before="):
        K.select_snapshot(snaps, jnp.array([-1, 0]))
    with pytest.raises(ValueError, match=r"values \[3\] outside \[0, 3\)"):
        K.select_snapshot(snaps, jnp.array([3, 0]))
    with pytest.raises(ValueError, match=r"values \[-2\] outside \[-1, 3\)"):
        K.select_snapshot(snaps, np.array([-2, 0]), before=s0)
    with pytest.raises(TypeError, match="index has dtype float32, expected integers"):
        K.select_snapshot(snaps, jnp.array([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"index has shape \(3,\), expected \(2,\)"):
        K.select_snapshot(snaps, jnp.array([0, 1, 2]))
    # -1 with `before`: a row that accepted no token keeps the state it had before the call.
    picked = K.select_snapshot(snaps, jnp.array([-1, 2]), before=s0)
    np.testing.assert_array_equal(picked.recurrent[0], s0.recurrent[0])
    np.testing.assert_array_equal(picked.conv[0], s0.conv[0])
    np.testing.assert_array_equal(picked.recurrent[1], snaps.recurrent[1, 2])
    # Under jit values cannot be checked: an out-of-range row is all NaN, never another row.
    jitted = jax.jit(lambda i: K.select_snapshot(snaps, i))(jnp.array([5, 1]))
    assert bool(jnp.isnan(jitted.recurrent[0]).all()) and bool(jnp.isnan(jitted.conv[0]).all())
    np.testing.assert_array_equal(jitted.recurrent[1], snaps.recurrent[1, 1])


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(gate_lower_bound=1.0), "gate_lower_bound=1.0 must be a finite negative"),
        (dict(gate_lower_bound=float("nan")), "gate_lower_bound=nan"),
        (dict(chunk=48), "chunk=48 must be a power of two"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0 must be a positive finite"),
        (dict(l2_eps=-1e-6), "l2_eps=-1e-06 must be a positive finite"),
        (dict(heads=True), "heads=True must be a positive int"),
        (dict(hidden=96.0), "hidden=96.0 must be a positive int"),
    ],
)
def test_invalid_config_cannot_be_built(change, pattern):
    """An invalid config is refused when built, so no entry point ever runs with one."""
    with pytest.raises(ValueError, match=pattern):
        K.preset("tiny").replace(**change)


def test_numpy_integer_scalars_are_ints():
    cfg = K.KdaConfig(hidden=np.int64(96), heads=np.int32(2), head_dim=np.int64(32), chunk=16)
    assert cfg == K.preset("tiny") and hash(cfg) == hash(K.preset("tiny"))
    assert type(cfg.hidden) is int
    s = K.KdaState.zeros(cfg, np.int64(2))
    assert s.recurrent.shape == (2, 2, 32, 32)
    with pytest.raises(TypeError, match="batch=2.0 must be an int"):
        K.KdaState.zeros(cfg, 2.0)
    with pytest.raises(ValueError, match="batch=-1 must be >= 0"):
        K.KdaState.zeros(cfg, -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_sequence(backend, rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 0, cfg.hidden))
    y, s = K.prefill(p, cfg, x, s0, backend=backend)
    assert y.shape == (2, 0, cfg.hidden)
    np.testing.assert_array_equal(s.recurrent, s0.recurrent)
    empty = K.KdaState.zeros(cfg, 0)
    y, s = K.prefill(p, cfg, jnp.zeros((0, 7, cfg.hidden)), empty, backend=backend)
    assert y.shape == (0, 7, cfg.hidden) and s.recurrent.shape == (0, 2, 32, 32)
    y, s = K.decode(p, cfg, jnp.zeros((0, cfg.hidden)), empty, backend=backend)
    assert y.shape == (0, cfg.hidden)
    y, s, snaps = K.decode_k(p, cfg, jnp.zeros((0, 3, cfg.hidden)), empty, backend=backend)
    assert y.shape == (0, 3, cfg.hidden) and snaps.recurrent.shape == (0, 3, 2, 32, 32)


def test_lengths_out_of_range_are_refused(rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 20, cfg.hidden))
    with pytest.raises(ValueError, match=r"lengths \[21, 3\] must lie in \[0, T=20\]"):
        K.prefill(p, cfg, x, s0, jnp.array([21, 3]))
    with pytest.raises(ValueError, match=r"lengths \[-1, 3\] must lie in \[0, T=20\]"):
        K.prefill(p, cfg, x, s0, np.array([-1, 3]))
    # Traced lengths cannot be checked: they are clipped to [0, T], as documented. The same
    # compiled program on the in-range lengths gives the same bits.
    run = jax.jit(lambda n: K.prefill(p, cfg, x, s0, n, backend="xla"))
    y_clip, s_clip = run(jnp.array([99, 3]))
    y_ref, s_ref = run(jnp.array([20, 3]))
    np.testing.assert_array_equal(y_clip, y_ref)
    np.testing.assert_array_equal(s_clip.recurrent, s_ref.recurrent)


def test_x64_runs_on_xla_and_is_refused_clearly_on_pallas(rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 20, cfg.hidden))
    y_ref, s_ref = K.prefill(p, cfg, x, s0, backend="xla")
    with jax.enable_x64(True):
        y, s = K.prefill(p, cfg, x, s0, backend="xla")
        with pytest.raises(NotImplementedError, match="jax_enable_x64"):
            K.prefill(p, cfg, x, s0, backend="pallas")
    assert_close(y, y_ref, FP32_TOL, "x64 output")
    assert_close(s.recurrent, s_ref.recurrent, FP32_TOL, "x64 state")


def test_wrong_argument_types_are_named(rng):
    cfg, p, s0, key = _block("tiny", rng)
    x = jax.random.normal(key, (2, 5, cfg.hidden))
    with pytest.raises(TypeError, match="cfg is a dict, expected a KdaConfig"):
        K.prefill(p, {"hidden": 96}, x, s0)
    with pytest.raises(TypeError, match="state is a tuple, expected a KdaState"):
        K.prefill(p, cfg, x, (s0.recurrent, s0.conv))
    with pytest.raises(ValueError, match=r"params.w_in has shape"):
        K.decode(K.init_params(K.preset("tiny-bounded").replace(hidden=64), rng), cfg, x[:, 0], s0)
