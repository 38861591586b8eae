"""pallas_kernels/gemv.py: gemv, gemv_batchm and the proj dispatch against gemv_reference.

On a CPU the kernels run in interpret mode at small odd shapes (N, D not tile multiples) and are
cross-lowered for an H200 at the block's real shapes; on a GPU (ON_GPU) the same tests run compiled
at the real shapes (Kimi-Linear: D = 2304, P = 4096, K = 128).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal

from pallas_kernels import common
from pallas_kernels import gemv as G
from pallas_kernels import reference as ref

BF16, F32 = jnp.bfloat16, jnp.float32

# The block's weights (N, D): w_in = q|k|v|f_a|g_a|b, o_proj, f_b (g_b has the same shape).
W_IN, O_PROJ, F_B = (3 * 4096 + 2 * 128 + 32, 2304), (2304, 4096), (4096, 128)
REAL_SHAPES = [W_IN, O_PROJ, F_B]
# CPU: N = 100 leaves a ragged last row tile; D = 96 runs 3 slices of 32, D = 176 one masked
# slice (bf16) or a full and a ragged one (fp32), D = 8 is below the tensor-core K of 16.
SMALL_SHAPES = [(100, 96), (100, 176), (37, 8), (64, 128)]
SHAPES = REAL_SHAPES if ON_GPU else SMALL_SHAPES
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]


def _inputs(key, n, d, m, x_dtype, w_dtype):
    kx, kw = jax.random.split(key)
    x = normal(kx, (m, d), x_dtype)
    w = normal(kw, (n, d), w_dtype, scale=d**-0.5)
    return x, w


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32}[a.itemsize]))


def _exact_rows(got_rows, want_rows, what):
    """Bitwise equality (also tells NaNs and signed zeros apart, unlike ==)."""
    assert got_rows.dtype == want_rows.dtype, (got_rows.dtype, want_rows.dtype)
    bad = np.argwhere(_bits(got_rows) != _bits(want_rows))
    assert bad.size == 0, f"{what}: {len(bad)} elements differ in bits, first at {bad[:4].tolist()}"


# --------------------------------------------------------------------------------------------
# Correctness against the reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,d", [SHAPES[0], *(pytest.param(*s, marks=pytest.mark.slow) for s in SHAPES[1:])]
)
@pytest.mark.parametrize(
    "m",
    [1, pytest.param(3, marks=pytest.mark.slow), 8, pytest.param(13, marks=pytest.mark.slow), 64],
)
@pytest.mark.parametrize("w_dtype", [BF16, F32])
def test_proj_matches_reference(rng, n, d, m, w_dtype):
    x, w = _inputs(rng, n, d, m, F32, w_dtype)
    want = ref.gemv_reference(x, w, out_dtype=F32)
    # fp32 output isolates the accumulation (bf16 products are exact in fp32).
    got = jax.jit(lambda x, w: G.proj(x, w, out_dtype=F32))(x, w)
    chex.assert_shape(got, (m, n))
    chex.assert_type(got, F32)
    assert_close(got, want, FP32_TOL, f"proj fp32 out, w {w_dtype.__name__} [{n}, {d}], M={m}")
    # Default out dtype = w.dtype: one rounding of the same sum.
    got = jax.jit(G.proj)(x, w)
    chex.assert_type(got, w_dtype)
    tol = TOL["bf16_stage"] if w_dtype == BF16 else FP32_TOL
    assert_close(got, ref.gemv_reference(x, w), tol, f"proj default out, M={m}")


def test_x_is_cast_to_weight_dtype_first(rng):
    """fp32 activations against bf16 weights round x to bf16 first, as the reference does."""
    n, d = SHAPES[0]
    x, w = _inputs(rng, n, d, 1, F32, BF16)
    got = G.gemv(x, w, out_dtype=F32)
    want = ref.gemv_reference(x.astype(BF16), w, out_dtype=F32)
    assert_close(got, want, FP32_TOL, "gemv with fp32 x")


# --------------------------------------------------------------------------------------------
# gemv_batchm rows == gemv rows, bit for bit (what makes decode_k equal serial decodes)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,d", [SHAPES[0], pytest.param(*SHAPES[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("w_dtype", [BF16, pytest.param(F32, marks=pytest.mark.slow)])
def test_batchm_rows_equal_gemv_bits(rng, n, d, w_dtype):
    ms = range(2, 9) if ON_GPU else (2, 5, 8)
    x8, w = _inputs(rng, n, d, 8, BF16, w_dtype)
    # fp32 output first: a bf16 output would hide most differences in the accumulation order.
    for out_dtype in (F32, w_dtype):
        one = jax.jit(G.gemv, static_argnames="out_dtype")
        many = jax.jit(G.gemv_batchm, static_argnames="out_dtype")
        rows = [one(x8[i : i + 1], w, out_dtype=out_dtype) for i in range(8)]
        for m in ms:
            got = many(x8[:m], w, out_dtype=out_dtype)
            chex.assert_shape(got, (m, n))
            for i in range(m):
                _exact_rows(got[i : i + 1], rows[i], f"gemv_batchm M={m} row {i} vs gemv")


def test_batchm_rows_do_not_see_other_rows(rng):
    """A row of inf/NaN leaves every other row's bits untouched (rows are independent)."""
    n, d = SHAPES[0]
    x, w = _inputs(rng, n, d, 4, BF16, BF16)
    x = x.at[2].set(jnp.nan).at[1, 3].set(jnp.inf)
    got = jax.jit(G.gemv_batchm, static_argnames="out_dtype")(x, w, out_dtype=F32)
    for i in (0, 3):
        want = G.gemv(x[i : i + 1], w, out_dtype=F32)
        _exact_rows(got[i : i + 1], want, f"row {i} beside NaN/inf rows")
    assert bool(jnp.all(jnp.isnan(got[2])))


# --------------------------------------------------------------------------------------------
# proj dispatch and small-K weights
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "m,kernel", [(1, True), (3, True), (8, True), (12, True), (64, True), (65, False)]
)
def test_proj_dispatch(rng, m, kernel):
    n, k = F_B if ON_GPU else (64, 128)  # f_b / g_b: [P, K], x [M, K]
    x, w = _inputs(rng, n, k, m, BF16, BF16)
    jaxpr = str(jax.make_jaxpr(G.proj)(x, w))
    assert ("pallas_call" in jaxpr) == kernel, f"M={m}: expected kernel={kernel}"
    got = G.proj(x, w, out_dtype=F32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # independent of XLA's dot
    assert_close(got, want, FP32_TOL, f"proj M={m}")
    if kernel and 1 < m <= G.MAX_KERNEL_ROWS:
        _exact_rows(got[:1], G.gemv(x[:1], w, out_dtype=F32), f"proj M={m} row 0")


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------
def test_bad_inputs_are_refused():
    x1 = jnp.ones((1, 96), BF16)
    w = jnp.ones((100, 96), BF16)
    with pytest.raises(ValueError, match="expected \\[M, D\\].*D = 96"):
        G.gemv(jnp.ones((1, 95), BF16), w)
    with pytest.raises(ValueError, match="expected \\[M, D\\]"):
        G.proj(jnp.ones((96,), BF16), w)
    with pytest.raises(ValueError, match="M = 2 rows, expected 1 <= M <= 1"):
        G.gemv(jnp.ones((2, 96), BF16), w)
    with pytest.raises(ValueError, match="M = 1 rows, expected 2 <= M <= 64"):
        G.gemv_batchm(x1, w)
    with pytest.raises(ValueError, match="M = 65 rows, expected 2 <= M <= 64"):
        G.gemv_batchm(jnp.ones((65, 96), BF16), w)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        G.gemv(x1, w.astype(jnp.float16))
    with pytest.raises(ValueError, match="expected \\[N, D\\]"):
        G.gemv(x1, w[None])
    with pytest.raises(ValueError, match="block_n=24: expected a power of two >= 16"):
        G.GemvBlockSizes(block_n=24, block_d=32)
    with pytest.raises(ValueError, match="m=65 rows"):
        G.GemvBlockSizes.get_default(100, 96, 65)


def test_default_block_sizes():
    """Sizes ignore M in 1..8 (bit equality needs one program) and again in 9..64; w_in fills
    132 SMs twice over with row tiles, o_proj four times over with row tiles times D splits;
    at 9..64 rows each weight gets at least one program per SM and slices of <= 128 columns."""
    for n, d in REAL_SHAPES + SMALL_SHAPES:
        sizes = {G.GemvBlockSizes.get_default(n, d, m) for m in range(1, 9)}
        assert len(sizes) == 1, (n, d, sizes)
        many = {G.GemvBlockSizes.get_default(n, d, m) for m in range(9, 65)}
        assert len(many) == 1 and next(iter(many)).block_d <= 128, (n, d, many)
    for n, d in REAL_SHAPES[:2]:
        bs = G.GemvBlockSizes.get_default(n, d, 64)
        assert common.cdiv(n, bs.block_n) * bs.split_d >= 132, (n, d, bs)
    bs = G.GemvBlockSizes.get_default(*W_IN)
    assert W_IN[1] % bs.block_d == 0 and common.cdiv(W_IN[0], bs.block_n) >= 2 * 132, bs
    bs = G.GemvBlockSizes.get_default(*O_PROJ)
    assert common.cdiv(O_PROJ[0], bs.block_n) * bs.split_d >= 4 * 132, bs
    assert O_PROJ[1] % (bs.split_d * bs.block_d) == 0, bs


# --------------------------------------------------------------------------------------------
# H200 cross-lowering at the real shapes (catches Triton lowering errors without a GPU)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,d", REAL_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 8, 64])
def test_lowers_for_h200(n, d, m):
    for w_dtype in (BF16, F32) if (n, d) == O_PROJ else (BF16,):
        x = jax.ShapeDtypeStruct((m, d), BF16)
        w = jax.ShapeDtypeStruct((n, d), w_dtype)
        fn = G.gemv if m == 1 else G.gemv_batchm
        text = lower_for_h200(lambda x, w, fn=fn: fn(x, w, interpret=False), x, w)
        bs = G.GemvBlockSizes.get_default(n, d, m, w_dtype)
        assert "xla.gpu.triton" in text, "no Triton kernel in the lowered module"
        assert f"grid_x = {common.cdiv(n, bs.block_n)} " in text, "unexpected grid"


@pytest.mark.slow
@pytest.mark.parametrize("split_d", [2, 4])
def test_split_reduction_matches_reference_and_keeps_row_bits(rng, split_d):
    """D split over programs (o_proj's tiling): same result, and rows still M-independent."""
    n, d = O_PROJ if ON_GPU else (40, 256)
    bs = G.GemvBlockSizes(block_n=16, block_d=32 if not ON_GPU else 256, split_d=split_d)
    x, w = _inputs(rng, n, d, 5, F32, BF16)
    got = G.gemv_batchm(x, w, out_dtype=F32, block_sizes=bs)
    assert_close(got, ref.gemv_reference(x, w, out_dtype=F32), FP32_TOL, "split gemv")
    for i in range(5):
        one = G.gemv(x[i : i + 1], w, out_dtype=F32, block_sizes=bs)
        _exact_rows(got[i : i + 1], one, f"split row {i}")


def test_default_splits_o_proj_only():
    assert G.GemvBlockSizes.get_default(*O_PROJ).split_d > 1
    assert G.GemvBlockSizes.get_default(*W_IN).split_d == 1
    assert G.GemvBlockSizes.get_default(*F_B).split_d == 1


# --------------------------------------------------------------------------------------------
# Output segments (w_in's parts written as separate arrays) and several weights in one launch
# --------------------------------------------------------------------------------------------
# w_in's parts: q|k|v, f_a, g_a, b on the GPU; on the CPU a ragged [100 + 16 + 16 + 5, 96].
W_IN_SPLITS = (3 * 4096, 128, 128, 32) if ON_GPU else (96, 16, 16, 5)


@pytest.mark.parametrize(
    "m", [*(pytest.param(m, marks=pytest.mark.slow) for m in (1, 8, 11, 64)), 5, 65]
)
def test_splits_match_reference_and_row_bits(rng, m):
    """Each segment equals the reference's columns; kernel rows (M <= 8) keep their bits across M;
    every kernel path (M <= 64) equals the unsplit kernel's bits (the segment is only where a
    tile is stored); M > 64 is XLA."""
    d = W_IN[1] if ON_GPU else 96
    x, w = _inputs(rng, sum(W_IN_SPLITS), d, m, BF16, BF16)
    got = jax.jit(lambda x, w: G.proj(x, w, out_dtype=F32, splits=W_IN_SPLITS))(x, w)
    want = ref.gemv_reference(x, w, out_dtype=F32, splits=W_IN_SPLITS)
    assert len(got) == len(W_IN_SPLITS)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == (m, W_IN_SPLITS[i]), a.shape
        assert_close(a, b, FP32_TOL, f"segment {i}, M={m}")
    if m <= G.MAX_TILE_ROWS:
        whole = G.proj(x, w, out_dtype=F32)
        _exact_rows(jnp.concatenate(got, axis=1), whole, f"segments vs unsplit, M={m}")
    if m <= G.MAX_KERNEL_ROWS:
        one = G.proj(x[-1:], w, out_dtype=F32, splits=W_IN_SPLITS)
        for i in range(len(got)):
            _exact_rows(got[i][-1:], one[i], f"segment {i}: last row of M={m} vs M=1")


@pytest.mark.parametrize(
    "m", [*(pytest.param(m, marks=pytest.mark.slow) for m in (1, 3, 12, 64)), 8, 65]
)
def test_proj_many_matches_reference_and_gemv_bits(rng, m):
    """Two weights in one launch (f_b, g_b): each output equals its own gemv bit for bit, and the
    reference within fp32 rounding."""
    n, d = F_B if ON_GPU else (100, 48)
    k1, k2 = jax.random.split(rng)
    (x1, w1), (x2, w2) = _inputs(k1, n, d, m, BF16, BF16), _inputs(k2, n, d, m, BF16, BF16)
    got = jax.jit(G.proj_many)((x1, x2), (w1, w2))
    want = ref.proj_many_reference((x1, x2), (w1, w2))
    for i, (a, b, x, w) in enumerate(zip(got, want, (x1, x2), (w1, w2), strict=True)):
        assert_close(a, b, TOL["bf16_stage"], f"proj_many output {i}, M={m}")
        if m <= G.MAX_TILE_ROWS:
            _exact_rows(a, G.proj(x, w), f"proj_many output {i} vs proj, M={m}")


def test_splits_and_groups_reject_bad_input():
    x, w = jnp.ones((2, 96), BF16), jnp.ones((100, 96), BF16)
    with pytest.raises(ValueError, match="summing to N=100"):
        G.proj(x, w, splits=(50, 40))
    for m in (2, 12, 65):  # the kernel paths and the XLA path refuse the same splits
        with pytest.raises(ValueError, match="multiple of 16 rows"):
            G.proj(jnp.ones((m, 96), BF16), w, splits=(50, 50))
        with pytest.raises(ValueError, match="same x and w shapes"):
            G.proj_many((jnp.ones((m, 96), BF16),) * 2, (w, w[:64]))
    with pytest.raises(ValueError, match="as many of each"):
        G.proj_many((x, x), (w,))
    with pytest.raises(ValueError, match="same x and w shapes"):
        G.proj_many((x, x), (w, w[:64]))


def test_split_bounds_lower_the_row_tile_only_when_needed():
    """w_in's bounds keep its default 32-row tile; a 16-aligned bound halves it; either way the
    tiling ignores M (rows keep their bits across M)."""
    n, d = W_IN
    default = G.GemvBlockSizes.get_default(n, d)
    kept = G._largest_block_n(default, G._bounds(n, (3 * 4096, 128, 128, 32)))
    assert kept == default and default.block_n == 32, (default, kept)
    lowered = G._largest_block_n(default, G._bounds(n, (3 * 4096 + 16, 112, 128, 32)))
    assert lowered.block_n == 16 and lowered.block_d == default.block_d, lowered


def test_splits_and_groups_lower_for_h200():
    """w_in with its four segments and f_b | g_b as one launch, at the real shapes."""
    x = jax.ShapeDtypeStruct((1, W_IN[1]), BF16)
    w = jax.ShapeDtypeStruct(W_IN, BF16)
    splits = (3 * 4096, 128, 128, 32)
    text = lower_for_h200(lambda x, w: G.gemv(x, w, splits=splits, interpret=False), x, w)
    assert text.count("xla.gpu.triton") == 1, "expected one kernel for the four segments"
    # proj sends w_in to the Mosaic GPU kernel (test_gemv_mgpu.py), also one launch.
    text = lower_for_h200(lambda x, w: G.proj(x, w, splits=splits, interpret=False), x, w)
    assert "xla.gpu.triton" not in text and text.count("custom_call @mosaic_gpu") == 1
    x = jax.ShapeDtypeStruct((4, F_B[1]), BF16)
    w = jax.ShapeDtypeStruct(F_B, BF16)
    text = lower_for_h200(lambda x, w: G.proj_many((x, x), (w, w), interpret=False), x, w)
    assert text.count("xla.gpu.triton") == 1, "expected one kernel for both weights"


@pytest.mark.parametrize("m", [3, 80])  # the kernel (M <= 64) and XLA's dots (M > 64)
def test_proj_many_adds_biases_as_its_reference_does(rng, m):
    k1, k2, k3, k4, k5 = jax.random.split(rng, 5)
    xs = [normal(k1, (m, 48), jnp.bfloat16), normal(k2, (m, 48), jnp.bfloat16)]
    ws = [normal(k3, (100, 48), jnp.bfloat16), normal(k4, (100, 48), jnp.bfloat16)]
    biases = (normal(k5, (100,)), None)
    got = G.proj_many(xs, ws, biases=biases)
    want = ref.proj_many_reference(xs, ws, biases=biases)
    for g, w_ in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w_, TOL["bf16_stage"], "proj_many with a bias")
    with pytest.raises(ValueError, match="biases"):
        G.proj_many(xs, ws, biases=(None,))
