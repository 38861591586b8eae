"""o_norm and o_norm_gate vs reference.o_norm_reference (interpret mode on a CPU, compiled on a
GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels import common
from pallas_kernels.o_norm import ONormBlockSizes, o_norm, o_norm_gate
from pallas_kernels.reference import gemv_reference, o_norm_reference

EPS = 1e-5
# Odd row counts on the CPU (3 heads of 32, 2 x 3 tokens); Kimi-Linear heads on a GPU.
LEAD, H, V = ((4, 5), 32, 128) if ON_GPU else ((2, 3), 3, 32)
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]


def _inputs(rng, in_dtype):
    ko, kz, kw = jax.random.split(rng, 3)
    o = normal(ko, (*LEAD, H, V), scale=0.3)
    z = normal(kz, (*LEAD, H * V), in_dtype, scale=2.0)
    w = 1.0 + 0.1 * normal(kw, (V,))
    return o, z, w


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_o_norm_matches_reference(rng, in_dtype, out_dtype):
    o, z, w = _inputs(rng, in_dtype)
    got = o_norm(o, z, w, eps=EPS, out_dtype=out_dtype)
    ref = o_norm_reference(o, z, w, eps=EPS, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (*LEAD, H * V)
    tol = FP32_TOL if out_dtype == jnp.float32 else TOL["bf16_stage"]
    assert_close(got, ref, tol, "o_norm")


def test_o_norm_multi_row_programs_match_reference(rng):
    """Enough rows for programs of several rows (the default above two programs per SM; the
    shapes above give one-row programs on the CPU): 2 x 133 tokens of 2 heads, 532 rows."""
    lead, h, v = (2, 133), 2, 32
    assert ONormBlockSizes.get_default(2 * 133 * h, v).block_rows > 1
    ko, kz, kw = jax.random.split(rng, 3)
    o = normal(ko, (*lead, h, v), scale=0.3)
    z = normal(kz, (*lead, h * v), jnp.bfloat16, scale=2.0)
    w = 1.0 + 0.1 * normal(kw, (v,))
    got = o_norm(o, z, w, eps=EPS, out_dtype=jnp.float32)
    assert_close(got, o_norm_reference(o, z, w, eps=EPS, out_dtype=jnp.float32), FP32_TOL, "o_norm")


def test_o_norm_default_tiling():
    """One-row programs while rows are few (decode: 32 heads at B=1, 256 at k=8); 64 rows of
    128 values per program for a prefill's many rows; at least two programs per SM otherwise."""
    assert ONormBlockSizes.get_default(32, 128).block_rows == 1
    assert ONormBlockSizes.get_default(256, 128).block_rows == 1
    assert ONormBlockSizes.get_default(8192 * 32, 128) == ONormBlockSizes(64, num_warps=4)
    for n in (2048, 640, 532):
        blk = ONormBlockSizes.get_default(n, 128)
        assert n % blk.block_rows == 0 and n // blk.block_rows >= 2 * 132, (n, blk)


def test_o_norm_rejects_bad_shapes(rng):
    o, z, w = _inputs(rng, jnp.float32)
    with pytest.raises(ValueError, match="z has shape"):
        o_norm(o, z[..., :-1], w, eps=EPS)
    with pytest.raises(ValueError, match="w has shape"):
        o_norm(o, z, w[:-1], eps=EPS)


@pytest.mark.parametrize("rows", [(1, 1), (4, 8), (1, 2048)])
def test_o_norm_lowers_for_h200(rows):
    """Kimi-Linear heads (H=32, V=128), decode and a small prefill."""
    o = jnp.ones((*rows, 32, 128), jnp.float32)
    z = jnp.ones((*rows, 32 * 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.float32)
    text = lower_for_h200(lambda *a: o_norm(*a, eps=EPS, interpret=False), o, z, w)
    assert "kda_o_norm" in text


@pytest.mark.parametrize("block_rows", [1, 4, None])
def test_o_norm_slots_fill_rows(rng, block_rows):
    """slots: a row of code -1 writes zeros and one below writes NaN, whatever o and z hold
    there (NaN in z must not leak through); the other rows are the norm. None: the default
    tiling, capped at one row's heads per program."""
    ko, kz = jax.random.split(rng)
    lead = (3, LEAD[-1])
    o = normal(ko, (*lead, H, V), scale=0.3)
    z = normal(kz, (*lead, H * V), scale=2.0).at[1].set(jnp.nan)
    o = o.at[2].set(jnp.inf)
    w = jnp.linspace(0.5, 1.5, V)
    codes = jnp.array([7, -1, -2], jnp.int32)
    per_row = lead[1] * H
    blk = None if block_rows is None else ONormBlockSizes(min(block_rows, per_row & -per_row))
    got = o_norm(o, z, w, eps=EPS, slots=codes, out_dtype=jnp.float32, block_sizes=blk)
    ref = o_norm_reference(o[:1], z[:1], w, eps=EPS, out_dtype=jnp.float32)
    assert bool((got[1] == 0).all()) and bool(jnp.isnan(got[2]).all())
    assert_close(got[:1], ref, FP32_TOL, "the row of a real slot")
    with pytest.raises(ValueError, match="slots has shape"):
        o_norm(o, z, w, eps=EPS, slots=codes[:2])
    if per_row % 2:
        with pytest.raises(ValueError, match="rows of one slot"):
            o_norm(o, z, w, eps=EPS, slots=codes, block_sizes=ONormBlockSizes(2))


# o_norm_gate: z formed in the kernel. Odd T on the CPU (a tile past T), Kimi-Linear on a GPU.
GATE_SHAPE = (2, 301, 32, 128, 128) if ON_GPU else (2, 37, 2, 32, 16)  # B, T, H, V, R


def _gate_inputs(rng, dtype, bias):
    b, t, h, v, r = GATE_SHAPE
    ko, ka, kb, kw, kc = jax.random.split(rng, 5)
    o = normal(ko, (b, t, h, v), scale=0.3)
    g_a = normal(ka, (b, t, r), dtype)
    g_b = normal(kb, (h * v, r), dtype, scale=0.3)
    w = 1.0 + 0.1 * normal(kw, (v,))
    g_bias = normal(kc, (h * v,)) if bias else None
    return o, g_a, g_b, w, g_bias


def _gate_reference(o, g_a, g_b, w, g_bias, keep, out_dtype):
    b, t, r = g_a.shape
    z = gemv_reference(g_a.reshape(b * t, r), g_b, out_dtype=jnp.float32, bias=g_bias)
    return o_norm_reference(o, z.reshape(b, t, -1), w, eps=EPS, keep=keep, out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_o_norm_gate_matches_reference(rng, dtype, bias):
    """Pads give 0 and the poisoned real tokens NaN whatever g_a holds there (NaN here); the
    rest equals the norm of the fp32 product g_a g_b^T (+ bias)."""
    o, g_a, g_b, w, g_bias = _gate_inputs(rng, dtype, bias)
    b, t = g_a.shape[:2]
    lengths = jnp.array([t - 5] + [t] * (b - 1), jnp.int32)
    poison = jnp.array([t - 2] + [t] * (b - 1), jnp.int32)
    keep = common.output_keep(lengths, t, poison)
    g_a = g_a.at[0, t - 4].set(jnp.nan).at[0, t - 1].set(jnp.nan)
    got = o_norm_gate(o, g_a, g_b, w, keep, eps=EPS, g_bias=g_bias, out_dtype=jnp.float32)
    want = _gate_reference(o, g_a, g_b, w, g_bias, keep, jnp.float32)
    assert got.shape == (b, t, o.shape[2] * o.shape[3])
    assert bool(jnp.isnan(got[0, t - 5 : t - 2]).all()) and bool((got[0, t - 2 :] == 0).all())
    real = jnp.arange(t)[None, :] < jnp.array([t - 5] + [t] * (b - 1))[:, None]
    tol = FP32_TOL if dtype == jnp.float32 else TOL["bf16_stage"]
    assert_close(got[real], want[real], tol, "o_norm_gate kept rows")
    assert not bool(jnp.isnan(got[real]).any())


@pytest.mark.parametrize("block_t", [16, 32])
def test_o_norm_gate_tilings_agree(rng, block_t):
    """A token's output does not depend on the tile that holds it."""
    o, g_a, g_b, w, g_bias = _gate_inputs(rng, jnp.bfloat16, True)
    keep = jnp.ones(g_a.shape[:2], jnp.float32)
    kw = dict(eps=EPS, g_bias=g_bias, out_dtype=jnp.float32)
    got = o_norm_gate(o, g_a, g_b, w, keep, block_t=block_t, **kw)
    assert_close(got, o_norm_gate(o, g_a, g_b, w, keep, **kw), FP32_TOL, f"block_t={block_t}")


def test_o_norm_gate_rejects_bad_shapes(rng):
    o, g_a, g_b, w, _ = _gate_inputs(rng, jnp.float32, False)
    keep = jnp.ones(g_a.shape[:2], jnp.float32)
    with pytest.raises(ValueError, match="o_norm_gate: g_a"):
        o_norm_gate(o, g_a, g_b[:-1], w, keep, eps=EPS)
    with pytest.raises(ValueError, match="keep"):
        o_norm_gate(o, g_a, g_b, w, keep[:, :-1], eps=EPS)
    with pytest.raises(ValueError, match="g_bias has shape"):
        o_norm_gate(o, g_a, g_b, w, keep, eps=EPS, g_bias=jnp.ones(3))
    with pytest.raises(ValueError, match="block_t=24"):
        o_norm_gate(o, g_a, g_b, w, keep, eps=EPS, block_t=24)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_o_norm_gate_lowers_for_h200(dtype):
    """Kimi-Linear geometry, T = 8191 (a last tile past T), with a bias."""
    o = jnp.ones((1, 8191, 32, 128), dtype)
    g_a = jnp.ones((1, 8191, 128), dtype)
    g_b = jnp.ones((4096, 128), dtype)
    w, keep, bias = jnp.ones((128,)), jnp.ones((1, 8191)), jnp.ones((4096,))
    fn = lambda *a: o_norm_gate(*a, eps=EPS, g_bias=bias, interpret=False)  # noqa: E731
    assert "kda_o_norm_gate" in lower_for_h200(fn, o, g_a, g_b, w, keep)
