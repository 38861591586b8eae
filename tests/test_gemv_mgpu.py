"""pallas_kernels/gemv_mgpu.py: the Mosaic GPU input projection against gemv_reference.

On a CPU the kernel runs in Mosaic GPU's interpret mode at a small geometry that keeps what the
real one has (at least 132 row tiles, a ragged last tile, a ragged last D step, four parts) and
is cross-lowered for an H200 at w_in's real shape; on a GPU (ON_GPU) the same tests run compiled
at w_in's real shape.
"""

from __future__ import annotations

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels import common
from pallas_kernels import gemv as G
from pallas_kernels import gemv_mgpu as MG
from pallas_kernels import reference as ref

BF16, F32 = jnp.bfloat16, jnp.float32

# w_in [q|k|v, f_a, g_a, b] of Kimi-Linear; on the CPU 133 row tiles of 64 (the last one 40
# rows) and D = 192 (a full step of 128 columns and a ragged one of 64).
W_IN, W_IN_SPLITS = (12576, 2304), (12288, 128, 128, 32)
SMALL, SMALL_SPLITS = (8488, 192), (8192, 128, 128, 40)
(N, D), SPLITS = (W_IN, W_IN_SPLITS) if ON_GPU else (SMALL, SMALL_SPLITS)


def _bits(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def _weight(key):
    return normal(key, (N, D), BF16, scale=D**-0.5)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 5, 16])
def test_matches_reference_and_keeps_row_bits(rng, m):
    kx, kw = jax.random.split(rng)
    x, w = normal(kx, (m, D), F32), _weight(kw)
    got = jax.jit(lambda x, w: MG.gemv_mgpu(x, w, splits=SPLITS))(x, w)
    want = ref.gemv_reference(x, w, splits=SPLITS)
    want32 = ref.gemv_reference(x, w, out_dtype=F32, splits=SPLITS)
    assert len(got) == len(SPLITS)
    for g, r, r32, width in zip(got, want, want32, SPLITS, strict=True):
        chex.assert_shape(g, (m, width))
        chex.assert_type(g, BF16)
        assert_close(g, r32, TOL["bf16_stage"], f"part of {width}, M={m}")
        assert_close(g, r, TOL["bf16_stage"], f"part of {width} against bf16, M={m}")
    for i in {0, m - 1}:  # a row's bits whatever M is and whatever the other rows hold
        one = MG.gemv_mgpu(x[i : i + 1], w, splits=SPLITS)
        for g, o in zip(got, one, strict=True):
            np.testing.assert_array_equal(_bits(g[i : i + 1]), _bits(o), f"row {i} of M={m}")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")
def test_non_finite_rows_stay_in_their_rows(rng):
    """The in-kernel transpose multiplies every row by 0 for every other row: a NaN or an inf
    must still reach its own row only."""
    kx, kw = jax.random.split(rng)
    x, w = normal(kx, (4, D), BF16), _weight(kw)
    poisoned = x.at[1].set(jnp.nan).at[2, 3].set(jnp.inf)
    got = jnp.concatenate(MG.gemv_mgpu(poisoned, w, splits=SPLITS), axis=1)
    for i in (0, 3):
        one = jnp.concatenate(MG.gemv_mgpu(x[i : i + 1], w, splits=SPLITS), axis=1)
        np.testing.assert_array_equal(_bits(got[i : i + 1]), _bits(one))
    assert bool(jnp.all(jnp.isnan(got[1]))), "a NaN row must give NaN"
    assert not bool(jnp.any(jnp.isfinite(got[2]))), "an inf input must leave no finite output"
    big = jnp.full((1, D), 3e38, BF16)  # bf16 overflow of the sum: +inf, as the reference's
    assert all(bool(jnp.all(jnp.isposinf(y))) for y in MG.gemv_mgpu(big, jnp.abs(w), splits=SPLITS))


def test_what_it_serves():
    """bf16 weight and output, 1..16 rows, D % 64, part widths of 8 (64s or below 64), inner
    bounds of 64, and at least one 64-row tile per SM; `proj` sends exactly those calls here."""
    fits = MG.mgpu_fits
    for m in (1, 8, 16):
        assert fits((m, 2304), W_IN, BF16, None, W_IN_SPLITS)
    assert not fits((17, 2304), W_IN, BF16, None, W_IN_SPLITS)
    assert not fits((1, 2304), W_IN, F32, None, W_IN_SPLITS)  # fp32 weight
    assert not fits((1, 2304), W_IN, BF16, F32, W_IN_SPLITS)  # fp32 output
    assert not fits((1, 2272), (12576, 2272), BF16, None, W_IN_SPLITS)  # D % 64
    assert not fits((1, 2304), W_IN, BF16, None, (12288, 128, 126, 34))  # width % 8
    assert not fits((1, 2304), W_IN, BF16, None, (12296, 120, 128, 32))  # bound % 64
    assert not fits((1, 2304), W_IN, BF16, None, None)  # one part of 12576: not 64s, not < 64
    assert not fits((1, 2304), W_IN, BF16, None, (12288, 128, 160))  # a last part of 160
    assert not fits((1, 4096), (2304, 4096), BF16, None, None)  # o_proj: 36 tiles
    assert not fits((1, 96), (258, 96), BF16, None, (192, 32, 32, 2))  # the tiny w_in


def test_proj_dispatch(monkeypatch):
    calls = []
    real = MG.gemv_mgpu
    monkeypatch.setattr(MG, "gemv_mgpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    for m, w_dtype, out, served in [
        (1, BF16, None, True),
        (16, BF16, None, True),
        (17, BF16, None, False),
        (1, F32, None, False),
        (1, BF16, F32, False),
    ]:
        calls.clear()
        x = jax.ShapeDtypeStruct((m, D), BF16)
        w = jax.ShapeDtypeStruct((N, D), w_dtype)
        jax.make_jaxpr(lambda x, w, out=out: G.proj(x, w, out_dtype=out, splits=SPLITS))(x, w)
        assert bool(calls) == served, (m, w_dtype, out)


def test_bad_inputs_are_refused():
    w = jnp.zeros((N, D), BF16)
    with pytest.raises(ValueError, match="gemv_mgpu: x"):
        MG.gemv_mgpu(jnp.zeros((17, D), BF16), w)
    with pytest.raises(ValueError, match="gemv_mgpu: x"):
        MG.gemv_mgpu(jnp.zeros((1, D), BF16), w.astype(F32))
    with pytest.raises(ValueError, match="gemv_mgpu: x"):
        MG.gemv_mgpu(jnp.zeros((1, D + 8), BF16), w)
    with pytest.raises(ValueError, match="block_n=256 must divide"):
        MG.gemv_mgpu(
            jnp.zeros((1, D), BF16),
            w,
            splits=SPLITS,
            block_sizes=MG.MgpuGemvBlockSizes(block_n=256),
        )
    with pytest.raises(ValueError, match="block_n=96"):
        MG.MgpuGemvBlockSizes(block_n=96)
    with pytest.raises(ValueError, match="block_k=96"):
        MG.MgpuGemvBlockSizes(block_k=96)


@pytest.mark.parametrize("m", [1, 8, 16])
def test_lowers_for_h200(m):
    """w_in's real shape and parts; the small geometry's too (a last part of 40)."""
    x = jax.ShapeDtypeStruct((m, SMALL[1]), BF16)
    w = jax.ShapeDtypeStruct(SMALL, BF16)
    text = lower_for_h200(
        lambda x, w: MG.gemv_mgpu(x, w, splits=SMALL_SPLITS, interpret=False), x, w
    )
    assert "kda_gemv_mgpu" in text
    x = jax.ShapeDtypeStruct((m, W_IN[1]), BF16)
    w = jax.ShapeDtypeStruct(W_IN, BF16)
    text = lower_for_h200(
        lambda x, w: MG.gemv_mgpu(x, w, splits=W_IN_SPLITS, interpret=False), x, w
    )
    assert "mosaic_gpu" in text and "kda_gemv_mgpu" in text, "no Mosaic GPU kernel lowered"


def test_hopper_by_compute_capability(monkeypatch):
    """On a GPU `proj` picks the Mosaic kernel by compute capability (sm_90 and newer only)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cc, want in (
        ("9.0", True),
        ("10.0", True),
        ("8.0", False),
        ("8.9", False),
        ("gfx90a", False),
    ):
        monkeypatch.setattr(
            jax, "devices", lambda cc=cc: [types.SimpleNamespace(compute_capability=cc)]
        )
        assert common.hopper() == want, cc
