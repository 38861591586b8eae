"""conv_decode / conv_prefill kernels vs their references; R-row vs serial bit-equality."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels.conv import ConvBlockSizes, conv_decode, conv_prefill, plan_decode
from pallas_kernels.reference import conv_decode_reference, conv_prefill_reference

# C = 3*H*K: 288 channels (9 head groups, not a power of two) on the CPU, Kimi-Linear on a GPU.
B, H, K, W = (4, 32, 128, 4) if ON_GPU else (2, 3, 32, 4)
C, QK = 3 * H * K, 2 * H * K
L2_EPS = 1e-6
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
KW = dict(qk_channels=QK, head_dim=K, l2_eps=L2_EPS)


def _taps(key):
    w = normal(key, (C, W), scale=0.5)
    return w.at[:, -1].add(1.0)


# 7: three programs per tile, the last one short
@pytest.mark.parametrize(
    "rows", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(7, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_conv_decode_matches_reference(rng, rows, dtype):
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (B, rows, C), dtype)
    state = normal(ks, (B, W - 1, C))
    w = _taps(kw)
    out, new_state, states = conv_decode(x, state, w, **KW, snapshots=True)
    out_ref, new_ref, states_ref = conv_decode_reference(x, state, w, **KW, snapshots=True)
    assert out.shape == (B, rows, C) and out.dtype == jnp.float32
    assert states.shape == (B, rows, W - 1, C) and states.dtype == jnp.float32
    assert new_state.shape == (B, W - 1, C) and new_state.dtype == jnp.float32
    assert_close(out, out_ref, FP32_TOL, "conv_decode out")
    np.testing.assert_array_equal(states, states_ref)  # the state is a copy of raw inputs
    np.testing.assert_array_equal(new_state, new_ref)
    np.testing.assert_array_equal(new_state, states[:, -1])
    out1, new1, none = conv_decode(x, state, w, **KW)  # no snapshots: the same out and state
    assert none is None
    np.testing.assert_array_equal(out1, out)
    np.testing.assert_array_equal(new1, new_state)
    # q and k heads are unit vectors, v is not normalised.
    norms = jnp.linalg.norm(out.reshape(B, rows, 3 * H, K), axis=-1)
    np.testing.assert_allclose(norms[..., : 2 * H], 1.0, **TOL["kernel_unit_norm"])


@pytest.mark.slow
def test_conv_decode_rows_equal_serial_bits(rng):
    """Row r of a 7-row call == the 1-row call fed the state after row r-1, bit for bit (rows
    0-2 in the program that reads the carried state and writes the new one, rows 3-5 in a
    second, row 6 in a third whose other two rows run past R and are not stored)."""
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (B, 7, C), jnp.bfloat16)
    state = normal(ks, (B, W - 1, C))
    w = _taps(kw)
    out, new, states = jax.jit(lambda *a: conv_decode(*a, **KW, snapshots=True))(x, state, w)
    step = jax.jit(lambda *a: conv_decode(*a, **KW))
    for r in range(7):
        out_r, state, _ = step(x[:, r : r + 1], state, w)
        np.testing.assert_array_equal(out[:, r], out_r[:, 0])
        np.testing.assert_array_equal(states[:, r], state)
    np.testing.assert_array_equal(new, state)


def test_conv_decode_programs_per_tile(rng):
    """One program per W-1 = 3 rows (the first of them alone reads the carried state)."""
    assert W == 4
    state, w = normal(rng, (B, W - 1, C)), _taps(rng)
    for rows, slots in ((1, 1), (2, 1), (3, 1), (4, 2), (7, 3), (8, 3)):
        plan = plan_decode(jnp.zeros((B, rows, C), jnp.bfloat16), state, w, **KW)
        assert plan.slots == slots and plan.programs == B * plan.tiles * slots, (rows, plan.slots)


@pytest.mark.parametrize("batch,rows", [pytest.param(1, 1, marks=pytest.mark.slow), (B, 3)])
def test_conv_decode_splits_equal_unsplit_bits(rng, batch, rows):
    """splits=(P, P, P): q, k, v written apart by the kernel, with the bits of the one-array
    call's columns, and the reference's split (within fp32 rounding); bad splits are refused."""
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (batch, rows, C), jnp.bfloat16)
    state = normal(ks, (batch, W - 1, C))
    w = _taps(kw)
    p = H * K
    fn = jax.jit(lambda *a: conv_decode(*a, **KW, splits=(p, p, p), snapshots=True))
    (q, k, v), new_state, states = fn(x, state, w)
    whole, new1, states1 = conv_decode(x, state, w, **KW, snapshots=True)
    parts_ref, _, _ = conv_decode_reference(x, state, w, **KW, splits=(p, p, p))
    for i, (a, a_ref) in enumerate(zip((q, k, v), parts_ref, strict=True)):
        assert a.shape == (batch, rows, p), a.shape
        np.testing.assert_array_equal(a, whole[..., i * p : (i + 1) * p])
        assert_close(a, a_ref, FP32_TOL, f"conv_decode split {i}")
    np.testing.assert_array_equal(states, states1)
    np.testing.assert_array_equal(new_state, new1)
    with pytest.raises(ValueError, match="summing to C"):
        conv_decode(x, state, w, **KW, splits=(p, p))
    with pytest.raises(ValueError, match="multiples of the"):  # a part ends inside a tile
        conv_decode(x, state, w, **KW, splits=(p - K // 2, p + K // 2, p))


def test_conv_block_sizes_are_validated():
    with pytest.raises(ValueError, match="block_heads=3"):
        ConvBlockSizes(block_heads=3)
    with pytest.raises(ValueError, match="num_warps=6"):
        ConvBlockSizes(block_heads=1, num_warps=6)
    with pytest.raises(ValueError, match="block_t=0"):
        ConvBlockSizes(block_heads=1, block_t=0)


def test_conv_decode_accepts_a_bf16_state(rng):
    """One row writes the state in place (fp32): a state of another dtype is converted first,
    as the reference does, rather than failing on the alias."""
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (B, 1, C), jnp.bfloat16)
    state = normal(ks, (B, W - 1, C), jnp.bfloat16)
    w = _taps(kw)
    out, new_state, _ = conv_decode(x, state, w, **KW)
    out_ref, new_ref, _ = conv_decode_reference(x, state, w, **KW)
    assert_close(out, out_ref, FP32_TOL, "conv_decode out, bf16 state")
    assert new_state.dtype == jnp.float32
    np.testing.assert_array_equal(new_state, new_ref)


# 4-row tiles on 13 rows: the first tile (carried state), two interior tiles, a short last one
@pytest.mark.parametrize("block_t", [None, 4])
@pytest.mark.parametrize("pad_value", [np.nan, pytest.param(1e30, marks=pytest.mark.slow)])
def test_conv_prefill_matches_reference_with_poisoned_pad(rng, pad_value, block_t):
    """Carried state, lengths below W-1, 0, inside an interior tile and T; pad positions hold
    NaN or 1e30."""
    t = 77 if ON_GPU else 13  # not a multiple of the time tile
    lengths = jnp.array([t, 2, 0, 9], jnp.int32)
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (len(lengths), t, C), jnp.bfloat16)
    pad = jnp.arange(t)[None, :, None] >= lengths[:, None, None]
    x = jnp.where(pad, jnp.asarray(pad_value, x.dtype), x)
    state = normal(ks, (len(lengths), W - 1, C))
    w = _taps(kw)
    blk = None if block_t is None else ConvBlockSizes(block_heads=1, block_t=block_t)
    out, new_state = conv_prefill(x, state, w, lengths, **KW, block_sizes=blk)
    out_ref, new_state_ref = conv_prefill_reference(x, state, w, lengths, **KW)
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert np.all(np.asarray(out)[np.broadcast_to(np.asarray(pad), out.shape)] == 0.0)
    assert_close(out, out_ref, FP32_TOL, "conv_prefill out")
    np.testing.assert_array_equal(new_state, new_state_ref)


@pytest.mark.parametrize("t", [0, pytest.param(77, marks=pytest.mark.slow)])
def test_conv_prefill_splits_equal_unsplit_bits(rng, t):
    """splits=(P, P, P): q, k, v written apart by the kernel with the bits of the one-array
    call's columns (NaN-poisoned pads, a length below W-1, an empty T; T = 77 spans two time
    tiles of 64, the second ragged); bad splits refused."""
    lengths = jnp.array([t, min(t, 2)], jnp.int32)
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (2, t, C), jnp.bfloat16)
    x = jnp.where(jnp.arange(t)[None, :, None] >= lengths[:, None, None], jnp.nan, x)
    state, w, p = normal(ks, (2, W - 1, C)), _taps(kw), C // 3
    whole, whole_state = conv_prefill(x, state, w, lengths, **KW)
    parts, state_s = conv_prefill(x, state, w, lengths, **KW, splits=(p, p, p))
    parts_ref, _ = conv_prefill_reference(x, state, w, lengths, **KW, splits=(p, p, p))
    assert len(parts) == 3
    for i, (part, ref_part) in enumerate(zip(parts, parts_ref, strict=True)):
        assert part.shape == (2, t, p) and part.dtype == jnp.float32
        np.testing.assert_array_equal(part, whole[..., i * p : (i + 1) * p])
        if t:  # (empty parts have nothing to compare)
            assert_close(part, ref_part, FP32_TOL, f"conv_prefill part {i}")
    np.testing.assert_array_equal(state_s, whole_state)
    with pytest.raises(ValueError, match="splits"):
        conv_prefill(x, state, w, lengths, **KW, splits=(p, p))
    with pytest.raises(ValueError, match="splits"):
        conv_prefill(x, state, w, lengths, **KW, splits=(p - K // 2, p + K // 2, p))


def test_conv_prefill_then_decode_equals_longer_prefill(rng):
    """Prefill of T tokens == prefill of T-1 tokens, then one decode row (state carried)."""
    t = 9
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (B, t, C))
    state = normal(ks, (B, W - 1, C))
    w = _taps(kw)
    full, full_state = conv_prefill(x, state, w, jnp.full((B,), t, jnp.int32), **KW)
    part, part_state = conv_prefill(x[:, :-1], state, w, jnp.full((B,), t - 1, jnp.int32), **KW)
    last, new_state, _ = conv_decode(x[:, -1:], part_state, w, **KW)
    assert_close(part, full[:, :-1], FP32_TOL, "prefix")
    assert_close(last[:, 0], full[:, -1], FP32_TOL, "decoded row")
    np.testing.assert_array_equal(new_state, full_state)


@pytest.mark.slow
def test_conv_prefill_out_dtype(rng):
    kx, ks, kw = jax.random.split(rng, 3)
    x = normal(kx, (B, 5, C))
    state, w = normal(ks, (B, W - 1, C)), _taps(kw)
    lengths = jnp.full((B,), 4, jnp.int32)
    out, _ = conv_prefill(x, state, w, lengths, out_dtype=jnp.bfloat16, **KW)
    out_ref, _ = conv_prefill_reference(x, state, w, lengths, out_dtype=jnp.bfloat16, **KW)
    assert out.dtype == jnp.bfloat16
    assert_close(out, out_ref, TOL["bf16_stage"], "conv_prefill bf16 out")


@pytest.mark.slow
def test_conv_tiles_of_several_heads(rng):
    """H = 4: 12 head groups, so each program owns several heads (the CPU default H = 3 gives
    9 groups, one per program); carried state, poisoned pad."""
    h = 4
    c, kw = 3 * h * K, dict(qk_channels=2 * h * K, head_dim=K, l2_eps=L2_EPS)
    kx, ks, kw_ = jax.random.split(rng, 3)
    x = normal(kx, (2, 6, c), jnp.bfloat16)
    state = normal(ks, (2, W - 1, c))
    w = normal(kw_, (c, W), scale=0.5).at[:, -1].add(1.0)
    out, new_state, states = conv_decode(x[:, :2], state, w, **kw, snapshots=True)
    out_ref, new_ref, states_ref = conv_decode_reference(x[:, :2], state, w, **kw, snapshots=True)
    assert_close(out, out_ref, FP32_TOL, "conv_decode out")
    np.testing.assert_array_equal(states, states_ref)
    np.testing.assert_array_equal(new_state, new_ref)
    lengths = jnp.array([6, 4], jnp.int32)
    x = jnp.where(jnp.arange(6)[None, :, None] >= lengths[:, None, None], jnp.nan, x)
    out, new_state = conv_prefill(x, state, w, lengths, **kw)
    out_ref, new_state_ref = conv_prefill_reference(x, state, w, lengths, **kw)
    assert_close(out, out_ref, FP32_TOL, "conv_prefill out")
    np.testing.assert_array_equal(new_state, new_state_ref)


def test_conv_rejects_bad_shapes(rng):
    x = normal(rng, (B, 1, C))
    state, w = jnp.ones((B, W - 1, C)), jnp.ones((C, W))
    with pytest.raises(ValueError, match="expected"):
        conv_decode(x, state[:, 1:], w, **KW)
    with pytest.raises(ValueError, match="head_dim"):
        conv_decode(x, state, w, qk_channels=QK, head_dim=K + 1, l2_eps=L2_EPS)
    with pytest.raises(ValueError, match="lengths"):
        conv_prefill(x, state, w, jnp.ones((B + 1,), jnp.int32), **KW)


KIMI = dict(qk_channels=2 * 4096, head_dim=128, l2_eps=L2_EPS)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("splits", [None, (4096,) * 3])
def test_conv_decode_lowers_for_h200(rows, splits):
    x = jnp.ones((2, rows, 12288), jnp.bfloat16)
    state, w = jnp.ones((2, 3, 12288)), jnp.ones((12288, 4))
    fn = lambda *a: conv_decode(  # noqa: E731
        *a, **KIMI, splits=splits, snapshots=rows > 1, interpret=False
    )
    text = lower_for_h200(fn, x, state, w)
    assert text.count("kda_conv_decode") >= 1 and text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("t", [100, 34, 5])  # 34, 5: shorter than a tile and its window
@pytest.mark.parametrize("splits", [None, (4096,) * 3])
def test_conv_prefill_lowers_for_h200(splits, t):
    x = jnp.ones((2, t, 12288), jnp.bfloat16)
    state, w = jnp.ones((2, 3, 12288)), jnp.ones((12288, 4))
    lengths = jnp.array([t, 3], jnp.int32)
    fn = lambda *a: conv_prefill(*a, **KIMI, splits=splits, interpret=False)  # noqa: E731
    text = lower_for_h200(fn, x, state, w, lengths)
    assert "kda_conv_prefill" in text and text.count("xla.gpu.triton") == 1
