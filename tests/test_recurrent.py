"""decode_core / fused_recurrent kernels vs their references; R-row vs serial bit-equality."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels.recurrent import RecurrentBlockSizes, decode_core, fused_recurrent
from pallas_kernels.reference import decode_core_reference, fused_recurrent_reference

B, H, K = (4, 32, 128) if ON_GPU else (2, 3, 32)
SCALE = K**-0.5
EPS = 1e-5
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
GATES = [None, -5.0]
# Whole-head V tile (fused RMSNorm epilogue) and a split V tile (separate o_norm kernel).
BLOCKS = [RecurrentBlockSizes.with_block_v(K, K), RecurrentBlockSizes.with_block_v(K, K // 2)]


def _unit(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _qkv(key, rows, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    q = _unit(normal(kq, (B, rows, H, K))).astype(dtype)
    k = _unit(normal(kk, (B, rows, H, K))).astype(dtype)
    v = normal(kv, (B, rows, H, K), dtype)
    return q, k, v


def _core_inputs(key, rows, dtype):
    """Inputs of decode_core: q, k, v, f, b, z, state, a_log, dt_bias, o_norm_w."""
    ks = jax.random.split(key, 8)
    q, k, v = _qkv(ks[0], rows, dtype)
    f = normal(ks[1], (B, rows, H * K), dtype)
    b = normal(ks[2], (B, rows, H), dtype, scale=2.0)
    z = normal(ks[3], (B, rows, H * K), dtype, scale=2.0)
    state = normal(ks[4], (B, H, K, K), scale=0.5)  # a carried, non-zero state
    a_log = normal(ks[5], (H,), scale=0.3)
    dt_bias = normal(ks[6], (H * K,), scale=1.5) - 1.0  # strong and weak decay mixed
    o_norm_w = 1.0 + 0.1 * normal(ks[7], (K,))
    return q, k, v, f, b, z, state, a_log, dt_bias, o_norm_w


def _fused_inputs(key, rows, dtype):
    """Inputs of fused_recurrent: q, k, v, f, b, state, a_log, dt_bias."""
    q, k, v, f, b, _, state, a_log, dt_bias, _ = _core_inputs(key, rows, dtype)
    return q, k, v, f, b, state, a_log, dt_bias


@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_recurrent_matches_reference(rng, rows, dtype):
    args = _fused_inputs(rng, rows, dtype)
    kw = dict(scale=SCALE, lower_bound=None)
    o, new_state, snaps = fused_recurrent(*args, **kw, snapshots=True)
    o_ref, state_ref, snaps_ref = fused_recurrent_reference(*args, **kw, snapshots=True)
    assert o.shape == (B, rows, H, K) and o.dtype == jnp.float32
    assert new_state.dtype == jnp.float32 and snaps.shape == (B, rows, H, K, K)
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(new_state, state_ref, FP32_TOL, "state")
    assert_close(snaps, snaps_ref, FP32_TOL, "snapshots")
    np.testing.assert_array_equal(snaps[:, -1], new_state)
    _, _, none = fused_recurrent(*args, **kw)
    assert none is None


@pytest.mark.parametrize("block", BLOCKS, ids=["fused_norm", "split_v"])
@pytest.mark.parametrize("lower_bound", GATES, ids=["unbounded", "bounded"])
@pytest.mark.parametrize(
    "rows,dtype", [pytest.param(1, jnp.float32, marks=pytest.mark.slow), (3, jnp.bfloat16)]
)
def test_decode_core_matches_reference(rng, block, lower_bound, rows, dtype):
    args = _core_inputs(rng, rows, dtype)
    kw = dict(scale=SCALE, lower_bound=lower_bound, eps=EPS, snapshots=True)
    y, new_state, snaps = decode_core(*args, **kw, out_dtype=jnp.float32, block_sizes=block)
    y_ref, state_ref, snaps_ref = decode_core_reference(*args, **kw, out_dtype=jnp.float32)
    assert y.shape == (B, rows, H * K) and y.dtype == jnp.float32
    assert_close(y, y_ref, FP32_TOL, "y")
    assert_close(new_state, state_ref, FP32_TOL, "state")
    assert_close(snaps, snaps_ref, FP32_TOL, "snapshots")


@pytest.mark.slow
@pytest.mark.parametrize("lower_bound", GATES, ids=["unbounded", "bounded"])
def test_decode_core_public_bf16_out(rng, lower_bound):
    args = _core_inputs(rng, 2, jnp.bfloat16)
    kw = dict(scale=SCALE, lower_bound=lower_bound, eps=EPS)
    y, new_state, snaps = decode_core(*args, **kw)
    y_ref, state_ref, _ = decode_core_reference(*args, **kw)
    assert y.dtype == jnp.bfloat16 and snaps is None
    assert_close(y, y_ref, TOL["bf16_stage"], "y")
    assert_close(new_state, state_ref, FP32_TOL, "state")


def test_fused_recurrent_in_kernel_l2(rng):
    """Raw q, k normalised in the kernel (FLA's use_qk_l2norm_in_kernel) == normalised before."""
    q, k, *rest = _fused_inputs(rng, 2, jnp.float32)
    kw = dict(scale=SCALE, lower_bound=None)
    o, state, _ = fused_recurrent(3.0 * q, 0.5 * k, *rest, **kw, l2_eps=1e-6)
    o_ref, state_ref, _ = fused_recurrent_reference(q, k, *rest, **kw)
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(state, state_ref, FP32_TOL, "state")


@pytest.mark.parametrize("block", BLOCKS, ids=["whole_v", "split_v"])
@pytest.mark.parametrize("lower_bound", GATES, ids=["unbounded", "bounded"])
def test_fused_recurrent_tilings(rng, block, lower_bound):
    """FLA's work, no RMSNorm: o is the fp32 read-out, on either V tile (a whole-head tile must
    not fuse the norm)."""
    args = _fused_inputs(rng, 3, jnp.bfloat16)
    kw = dict(scale=SCALE, lower_bound=lower_bound)
    o, new_state, _ = fused_recurrent(*args, **kw, block_sizes=block)
    o_ref, state_ref, _ = fused_recurrent_reference(*args, **kw)
    assert o.shape == (B, 3, H, K) and o.dtype == jnp.float32
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(new_state, state_ref, FP32_TOL, "state")


@pytest.mark.parametrize(
    "block",
    [BLOCKS[0], pytest.param(BLOCKS[1], marks=pytest.mark.slow)],
    ids=["fused_norm", "split_v"],
)
def test_decode_core_rows_equal_serial_bits(rng, block):
    """decode_k's promise: an R-row call == R serial 1-row calls, bit for bit, snapshots too."""
    rows = 3
    q, k, v, f, b, z, state, a_log, dt_bias, w = _core_inputs(rng, rows, jnp.bfloat16)
    kw = dict(scale=SCALE, lower_bound=None, eps=EPS, out_dtype=jnp.bfloat16, block_sizes=block)
    many = jax.jit(lambda *a: decode_core(*a, snapshots=True, **kw))
    one = jax.jit(lambda *a: decode_core(*a, snapshots=False, **kw))
    y, final, snaps = many(q, k, v, f, b, z, state, a_log, dt_bias, w)
    for r in range(rows):
        row = [a[:, r : r + 1] for a in (q, k, v, f, b, z)]
        y_r, state, _ = one(*row, state, a_log, dt_bias, w)
        np.testing.assert_array_equal(y[:, r], y_r[:, 0])
        np.testing.assert_array_equal(snaps[:, r], state)
    np.testing.assert_array_equal(final, state)


def test_recurrent_state_updates_in_place_when_donated(rng):
    """A donated state is accepted (the kernel aliases state in and out) and the result holds."""
    q, k, v, f, b, state, a_log, dt_bias = _fused_inputs(rng, 1, jnp.float32)
    kw = dict(scale=SCALE, lower_bound=None)
    fn = jax.jit(
        lambda s: fused_recurrent(q, k, v, f, b, s, a_log, dt_bias, **kw)[1], donate_argnums=0
    )
    expected = fused_recurrent_reference(q, k, v, f, b, state, a_log, dt_bias, **kw)[1]
    got = fn(state)
    assert state.is_deleted()
    assert_close(got, expected, FP32_TOL, "state")


def test_decode_core_rejects_bad_shapes(rng):
    args = list(_core_inputs(rng, 1, jnp.float32))
    kw = dict(scale=SCALE, lower_bound=None, eps=EPS)
    bad_state = args[:6] + [args[6][:, :, :, :-1]] + args[7:]
    with pytest.raises(ValueError, match="state has shape"):
        decode_core(*bad_state, **kw)
    bad_f = args[:3] + [args[3][..., :-1]] + args[4:]
    with pytest.raises(ValueError, match="expected"):
        decode_core(*bad_f, **kw)


def _kimi(rows, batch=2):
    h, kd = 32, 128
    z = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    return (
        z(batch, rows, h, kd),
        z(batch, rows, h, kd),
        z(batch, rows, h, kd),
        z(batch, rows, h * kd),
        z(batch, rows, h),
        z(batch, rows, h * kd),
        z(batch, h, kd, kd),
        z(h),
        z(h * kd),
        z(kd),
    )


@pytest.mark.parametrize("rows,snapshots", [(1, False), (3, True), (8, True)])
@pytest.mark.parametrize("block_v", [128, 32])
@pytest.mark.parametrize("lower_bound", GATES, ids=["unbounded", "bounded"])
def test_decode_core_lowers_for_h200(rows, snapshots, block_v, lower_bound):
    block = RecurrentBlockSizes.with_block_v(128, block_v)
    text = lower_for_h200(
        lambda *a: decode_core(
            *a,
            scale=128**-0.5,
            lower_bound=lower_bound,
            eps=EPS,
            snapshots=snapshots,
            out_dtype=jnp.bfloat16,
            block_sizes=block,
            interpret=False,
        ),
        *_kimi(rows),
    )
    assert "kda_recurrent" in text


def test_fused_recurrent_lowers_for_h200():
    q, k, v, f, b, _, state, a_log, dt_bias, _ = _kimi(4)
    fn = lambda *a: fused_recurrent(  # noqa: E731
        *a, scale=128**-0.5, lower_bound=None, l2_eps=1e-6, snapshots=True, interpret=False
    )
    text = lower_for_h200(fn, q, k, v, f, b, state, a_log, dt_bias)
    assert "kda_recurrent" in text


def test_default_block_v_follows_batch_not_rows():
    """V tile 32 at small B*H, 64 once B*H >= 1024 (measured at B=64, H=32), capped at V; the
    warps per tile as measured at B=64 (4 for the [128, 64] tile)."""
    assert RecurrentBlockSizes.get_default(1, 32, 128, 128).block_v == 32
    assert RecurrentBlockSizes.get_default(31, 32, 128, 128).block_v == 32
    assert RecurrentBlockSizes.get_default(64, 32, 128, 128).block_v == 64
    assert RecurrentBlockSizes.get_default(64, 32, 128, 32).block_v == 32
    assert RecurrentBlockSizes.get_default(64, 32, 128, 128).num_warps == 4
    assert RecurrentBlockSizes.get_default(1, 32, 128, 128).num_warps == 4
    # Warps per tile: 32 values per thread up to 4 warps, 64 per thread beyond.
    warps = {bv: RecurrentBlockSizes.with_block_v(128, bv).num_warps for bv in (8, 16, 32, 64, 128)}
    assert warps == {8: 1, 16: 2, 32: 4, 64: 4, 128: 8}
