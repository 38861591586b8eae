"""o_norm kernel vs reference.o_norm_reference (interpret mode on a CPU, compiled on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels.o_norm import ONormBlockSizes, o_norm
from pallas_kernels.reference import o_norm_reference

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


@pytest.mark.parametrize("block_rows", [1, 4])
def test_o_norm_keep_replaces_rows(rng, block_rows):
    """keep: 1 keeps a token's norm, 0 writes zeros and NaN writes NaN, whatever o and z hold
    there (the prefill's pads: NaN in z must not leak through)."""
    o, z, w = _inputs(rng, jnp.float32)
    keep = jnp.ones(LEAD).at[0, 1].set(0.0).at[1, 2].set(jnp.nan)
    z = z.at[0, 1].set(jnp.nan)
    blk = ONormBlockSizes(block_rows=min(block_rows, H & -H))
    got = o_norm(o, z, w, eps=EPS, keep=keep, out_dtype=jnp.float32, block_sizes=blk)
    ref = o_norm_reference(o, z, w, eps=EPS, keep=keep, out_dtype=jnp.float32)
    assert bool((got[0, 1] == 0).all()) and bool(jnp.isnan(got[1, 2]).all())
    kept = jnp.ones(LEAD, bool).at[0, 1].set(False).at[1, 2].set(False)
    assert_close(got[kept], ref[kept], FP32_TOL, "kept rows")
    with pytest.raises(ValueError, match="keep has shape"):
        o_norm(o, z, w, eps=EPS, keep=jnp.ones(LEAD[-1:]))
