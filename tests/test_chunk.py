"""Chunked prefill (SPEC §5): chunk_prepare, chunk_scan and prefill_core against their references.

On a CPU the kernels run in interpret mode at small odd sizes (H=2, K=32, chunk 16/32/64, T and
lengths not chunk multiples, NaN-poisoned pads, carried state, both gates, strong decay); the
cross-lowering tests build the real Triton IR at the Kimi-Linear sizes. On a GPU the same file
compiles the kernels and checks the bf16 path at T=4096, H=32, K=128 against the fp32 reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, lower_for_h200, normal, rel_rms
from jax.scipy.linalg import solve_triangular

from pallas_kernels import reference as ref
from pallas_kernels.chunk import chunk_kda, prefill_core
from pallas_kernels.chunk_prepare import ChunkIntermediates, PrepareBlockSizes, chunk_prepare
from pallas_kernels.chunk_scan import ScanBlockSizes, chunk_scan
from pallas_kernels.chunk_scores import chunk_scores
from pallas_kernels.chunk_vjp import chunk_kda_vjp

f32, bf16 = jnp.float32, jnp.bfloat16
EPS = 1e-5
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
# Interpret-mode sizes: 2 sequences, 2 heads of 32, T = 37 (not a chunk multiple).
B, T, H, K = 2, 37, 2, 32


def _inputs(rng, *, b=B, t=T, h=H, kd=K, dtype=f32, decay="moderate", lengths=None, poison=True):
    """Raw prefill-core inputs: q, k L2-normalised, v, f, b, g_a, g_b (the output gate's
    projection, z = g_a g_b^T), state, lengths, a_log, dt_bias, w.

    decay: "moderate" (|g| ~ 0.1-3 per token), "weak" (|g| ~ 1e-3) or "strong" (|g| up to ~50).
    Pads (t >= lengths[b]) hold NaN in every token input when `poison`.
    """
    ks = jax.random.split(rng, 10)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    q = l2(normal(ks[0], (b, t, h, kd))).astype(dtype)
    k = l2(normal(ks[1], (b, t, h, kd))).astype(dtype)
    v = normal(ks[2], (b, t, h, kd)).astype(dtype)
    f = normal(ks[3], (b, t, h * kd), dtype)
    beta = normal(ks[4], (b, t, h), dtype, scale=1.5)
    k_ga, k_gb = jax.random.split(ks[5])
    g_a = normal(k_ga, (b, t, 16), dtype)
    g_b = normal(k_gb, (h * kd, 16), dtype, scale=0.5)
    state = normal(ks[6], (b, h, kd, kd), scale=0.5)
    a_log = {"moderate": 0.0, "weak": -6.0, "strong": math.log(25.0)}[decay]
    a_log = a_log + 0.3 * normal(ks[7], (h,))
    dt_bias = 0.5 * normal(ks[8], (h * kd,))
    w = 1.0 + 0.1 * normal(ks[9], (kd,))
    if lengths is None:
        lengths = jnp.asarray([t] + [max(1, (t * (i + 1)) // (b + 1) - 3) for i in range(b - 1)])
    lengths = jnp.asarray(lengths, jnp.int32)
    if poison:
        pad = jnp.arange(t)[None, :] >= lengths[:, None]
        nan = lambda x, m: jnp.where(m, jnp.asarray(jnp.nan, x.dtype), x)  # noqa: E731
        q, k, v = (nan(x, pad[..., None, None]) for x in (q, k, v))
        f, g_a = (nan(x, pad[..., None]) for x in (f, g_a))
        beta = nan(beta, pad[..., None])
    return q, k, v, f, beta, g_a, g_b, state, lengths, a_log, dt_bias, w


def _prep_args(inp):
    q, k, v, f, beta, _, _, _, lengths, a_log, dt_bias, _ = inp
    return q, k, v, f, beta, lengths, a_log, dt_bias


def _token_loop(inp, *, lower_bound):
    """The fp32 token-by-token recurrence with the same pad semantics, then the gated norm."""
    q, k, v, f, beta_logits, g_a, g_b, state, lengths, a_log, dt_bias, w = inp
    t, kd = q.shape[1], q.shape[-1]
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    g, beta = ref.gate_reference(
        f, beta_logits, a_log, dt_bias, head_dim=kd, lower_bound=lower_bound
    )
    vm = valid[..., None, None]
    q, k, v, g = (jnp.where(vm, x.astype(f32), 0.0) for x in (q, k, v, g))
    beta = jnp.where(valid[..., None], beta, 0.0)
    o, new_state, _ = ref.recurrent_reference(q, k, v, g, beta, state, scale=kd**-0.5)
    z = jnp.einsum("btr,pr->btp", g_a.astype(f32), g_b.astype(f32), precision="highest")
    y = ref.o_norm_reference(o, z, w, eps=EPS, out_dtype=f32)
    return jnp.where(valid[..., None], y, 0.0), new_state


def _assert_finite(*xs):
    for x in xs:
        assert bool(jnp.all(jnp.isfinite(jnp.asarray(x, f32)))), "NaN or inf in the output"


# ----------------------------------------------------------------------------------------------
# chunk_prepare
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chunk, lower_bound",
    [
        pytest.param(16, None, marks=pytest.mark.slow),
        pytest.param(16, -5.0, marks=pytest.mark.slow),
        (32, None),
        pytest.param(32, -5.0, marks=pytest.mark.slow),
        pytest.param(32, -8.0, marks=pytest.mark.slow),
        pytest.param(64, None, marks=pytest.mark.slow),
    ],
    ids=[
        "c16-unbounded",
        "c16-bounded",
        "c32-unbounded",
        "c32-bounded",
        "c32-strong-bounded",
        "c64-unbounded",
    ],
)
def test_prepare_matches_reference(rng, chunk, lower_bound):
    """fp32 intermediates, both gates (a strong bounded one too): the diagonal kernel's
    sub-blocks, off-diagonal sub-blocks (chunk >= 32), T and lengths off the chunk grid, NaN
    pads."""
    args = _prep_args(_inputs(rng))
    kw = dict(scale=K**-0.5, chunk=chunk, lower_bound=lower_bound, mm_dtype=f32)
    got = chunk_prepare(*args, **kw)
    want = ChunkIntermediates(*ref.chunk_prepare_reference(*args, **kw))
    for name in ChunkIntermediates._fields:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        assert_close(g, w, FP32_TOL, f"chunk_prepare.{name}")


@pytest.mark.slow
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
def test_prepare_diagonal_at_block_edges(rng, lower_bound):
    """The diagonal kernel where a sequence ends at its edges: one token, at the end of the
    first half of a 16-row block, at the end of a block, one token past it."""
    args = _prep_args(_inputs(rng, b=4, lengths=[1, 8, 16, 17]))
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=lower_bound, mm_dtype=f32)
    got = chunk_prepare(*args, **kw)
    want = ChunkIntermediates(*ref.chunk_prepare_reference(*args, **kw))
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, f"chunk_prepare.{name}")


@pytest.mark.slow
def test_prepare_bf16_storage(rng):
    """bf16 inputs and intermediates (the production path) against the fp32-math reference."""
    args = _prep_args(_inputs(rng, dtype=bf16))
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=None, mm_dtype=bf16)
    got = chunk_prepare(*args, **kw)
    want = ChunkIntermediates(*ref.chunk_prepare_reference(*args, **{**kw, "mm_dtype": f32}))
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), TOL["bf16_stage"], name)


@pytest.mark.slow
def test_prepare_fused_l2(rng):
    """Raw q, k normalised in the kernel (the benchmark's FLA-like entry) == pre-normalised."""
    q, k, v, f, beta, lengths, a_log, dt_bias = _prep_args(_inputs(rng))
    kw = dict(scale=K**-0.5, chunk=32, lower_bound=None, mm_dtype=f32)
    got = chunk_prepare(3.0 * q, 0.5 * k, v, f, beta, lengths, a_log, dt_bias, **kw, l2_eps=1e-6)
    want = chunk_prepare(q, k, v, f, beta, lengths, a_log, dt_bias, **kw)
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "blk",
    [
        PrepareBlockSizes.get_default(K, K),
        PrepareBlockSizes(block_k=16, num_stages=1, diag_warps=4, wu_block_k=16),
        PrepareBlockSizes(block_k=32, wu_block_k=32, wu_stages=2),
    ],
    ids=["default", "unpipelined", "wu-pipelined"],
)
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
def test_prepare_column_slices(rng, lower_bound, blk):
    """Four sub-blocks (chunk 64) with the L2 norm fused, K and V in one 32-wide slice (the
    default's 64 capped at K) or streamed in two (block_k=16 of 32): the scores summed slice by
    slice equal the reference; the w/u kernel on one 32-wide slice or two 16-wide ones, loads
    pipelined or not (stages matter on a GPU)."""
    q, k, v, f, beta, lengths, a_log, dt_bias = _prep_args(_inputs(rng))
    kw = dict(scale=K**-0.5, chunk=64, lower_bound=lower_bound, mm_dtype=f32)
    got = chunk_prepare(
        3.0 * q, 0.5 * k, v, f, beta, lengths, a_log, dt_bias, **kw, l2_eps=1e-6, block_sizes=blk
    )
    want = ChunkIntermediates(
        *ref.chunk_prepare_reference(q, k, v, f, beta, lengths, a_log, dt_bias, **kw)
    )
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "lower_bound, block_k",
    [(None, 64), (None, 128), (-5.0, 64)],
    ids=["unbounded-64", "unbounded-128", "bounded-64"],
)
def test_prepare_wide_slices(rng, lower_bound, block_k):
    """The main kernel at K = V = 128 in slices of 64 (the default: two per row) or 128 (one),
    the L2 norm fused, chunk 32, NaN pads: equal to the reference."""
    q, k, v, f, beta, lengths, a_log, dt_bias = _prep_args(_inputs(rng, h=1, kd=128))
    blk = dataclasses.replace(PrepareBlockSizes.get_default(128, 128), block_k=block_k)
    kw = dict(scale=128**-0.5, chunk=32, lower_bound=lower_bound, mm_dtype=f32)
    got = chunk_prepare(
        2.0 * q, 0.5 * k, v, f, beta, lengths, a_log, dt_bias, **kw, l2_eps=1e-6, block_sizes=blk
    )
    want = ChunkIntermediates(
        *ref.chunk_prepare_reference(q, k, v, f, beta, lengths, a_log, dt_bias, **kw)
    )
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, name)


def test_prepare_default_block_sizes_fit_head_dim():
    assert PrepareBlockSizes.get_default(128, 128) == PrepareBlockSizes()
    assert PrepareBlockSizes.get_default(32, 64).wu_block_k == 32
    assert PrepareBlockSizes.get_default(32, 64).block_k == 32
    assert PrepareBlockSizes.get_default(16, 64) == PrepareBlockSizes(block_k=16, wu_block_k=16)


def test_scan_default_block_sizes():
    """BV 64 with two stages once that makes >= 256 programs; fewer programs: BV 32 with three
    stages at C <= 32, and at C = 64 two stages with BV halved down to 16 until there are 256
    (the reasons in `ScanBlockSizes.get_default`)."""
    for chunk in (16, 32):
        assert ScanBlockSizes.get_default(1, 32, 128, chunk) == ScanBlockSizes(32, 4, 3)
        assert ScanBlockSizes.get_default(4, 32, 128, chunk) == ScanBlockSizes(64, 4, 2)
    assert ScanBlockSizes.get_default(1, 32, 16, 32) == ScanBlockSizes(16, 4, 3)
    assert ScanBlockSizes.get_default(1, 32, 128, 64) == ScanBlockSizes(16, 4, 2)
    assert ScanBlockSizes.get_default(2, 32, 128, 64) == ScanBlockSizes(32, 4, 2)
    assert ScanBlockSizes.get_default(4, 32, 128, 64) == ScanBlockSizes(64, 4, 2)


@pytest.mark.parametrize("name", ["block_k", "wu_block_k"])
def test_prepare_rejects_bad_block_k(rng, name):
    args = _prep_args(_inputs(rng))
    with pytest.raises(ValueError, match=f"{name}=24 must be a power of two"):
        chunk_prepare(
            *args,
            scale=K**-0.5,
            chunk=16,
            lower_bound=None,
            mm_dtype=f32,
            l2_eps=None,
            block_sizes=dataclasses.replace(PrepareBlockSizes.get_default(K, K), **{name: 24}),
        )


@pytest.mark.slow
def test_prepare_strong_decay_is_finite_and_exact(rng):
    """Unbounded gate with per-token log-decay down to about -50: no exp overflow anywhere."""
    inp = _inputs(rng, decay="strong")
    args = _prep_args(inp)
    g, _ = ref.gate_reference(args[3], args[4], args[6], args[7], head_dim=K, lower_bound=None)
    assert float(jnp.nanmin(g)) < -40.0, "the test must reach strong decay"
    kw = dict(scale=K**-0.5, chunk=64, lower_bound=None, mm_dtype=f32)
    got = chunk_prepare(*args, **kw)
    _assert_finite(*got)
    want = ChunkIntermediates(*ref.chunk_prepare_reference(*args, **kw))
    for name in ("w", "u", "a"):
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, name)


@pytest.mark.slow
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
def test_prepare_inverse_vs_float64_solve(rng, lower_bound):
    """(I+L)^-1 against a float64 solve, on an ill-conditioned chunk (correlated keys, beta near
    1, weak decay): no worse than the fp32 reference's solve. The diagonal blocks come from the
    diagonal kernel's forward substitution, the off-diagonal blocks from block substitution."""
    # Weak decay: unbounded exp(A_log) ~ e^-6; bounded lb sigmoid(exp(A_log) u) with A_log ~ 0
    # and u ~ -8, ~2e-3 per token.
    q, k, v, f, beta, _, _, _, lengths, a_log, dt_bias, _ = _inputs(
        rng, b=1, t=64, decay="weak" if lower_bound is None else "moderate", poison=False
    )
    if lower_bound is not None:
        f = f - 8.0
    base = normal(jax.random.fold_in(rng, 1), (1, 1, H, K))
    k = base + 0.25 * k
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = 3.0 + 0.1 * beta
    args = (q, k, v, f, beta, lengths, a_log, dt_bias)
    kw = dict(scale=K**-0.5, chunk=64, lower_bound=lower_bound)
    got = chunk_prepare(*args, **kw, mm_dtype=f32)
    fp32_solve = ref.chunk_prepare_reference(*args, **kw, mm_dtype=f32)[3]
    # float64: the same L and beta*v from float64 math, solved in float64.
    g, bt = ref.gate_reference(f, beta, a_log, dt_bias, head_dim=K, lower_bound=lower_bound)
    g64, k64, v64 = (np.asarray(x[0], np.float64).transpose(1, 0, 2) for x in (g, k, v))
    b64 = np.asarray(bt[0], np.float64).T[..., None]  # [H, T, 1]
    gc = np.cumsum(g64, axis=1)
    dec = np.exp(
        np.where(
            np.tril(np.ones((64, 64)), -1)[..., None] > 0,
            gc[:, :, None, :] - gc[:, None, :, :],
            -np.inf,
        )
    )
    lmat = b64 * np.einsum("hik,hjk,hijk->hij", k64, k64, dec)
    u64 = np.linalg.solve(np.eye(64) + lmat, b64 * v64)  # [H, T, V]
    cond = max(np.linalg.cond(np.eye(64) + lmat[i]) for i in range(H))
    err_kernel = rel_rms(got.u[0], u64)
    err_fp32 = rel_rms(fp32_solve[0], u64)
    print(
        f"cond(I+L) = {cond:.1e}; rel RMS vs float64: kernel {err_kernel:.2e}, "
        f"fp32 reference {err_fp32:.2e}"
    )
    assert cond > 10.0, "the chunk must be ill-conditioned for this test to mean anything"
    if ON_GPU:
        # Compiled, the kernel's fp32 products are TF32 (PALLAS.md): SPEC §8's bar for TF32
        # paths applies. (Held to the CPU criterion below, the H200 run of 2026-11-30 failed.)
        assert err_kernel < TOL["fp32_gpu"]
    else:
        assert err_kernel < max(TOL["solve_vs_fp32_solve"] * err_fp32, TOL["solve_floor"])


@pytest.mark.parametrize("c", [16, 32, 64])
def test_unit_lower_solve_against_float64_and_its_gradient(rng, c):
    """The reference's solve (inverse by block doubling): on ill-conditioned unit lower
    matrices (correlated keys, beta near 1) with junk above the diagonal, fp32 error no worse
    than fp32 solve_triangular's against float64; its VJP equals autodiff of
    solve_triangular in float64 (zero on and above the diagonal)."""
    k1, k2, k3, k4 = jax.random.split(rng, 4)
    keys = normal(k1, (1, 128)) + 0.25 * normal(k2, (12, c, 128))
    keys = keys / jnp.linalg.norm(keys, axis=-1, keepdims=True)
    m = jnp.eye(c) + 0.95 * jnp.tril(keys @ jnp.swapaxes(keys, -1, -2), -1)
    m = m + jnp.triu(normal(k3, (c, c)), 1)
    rhs = normal(k4, (12, c, 96))
    m64, rhs64 = np.asarray(m, np.float64), np.asarray(rhs, np.float64)
    want = np.linalg.solve(np.tril(m64, -1) + np.eye(c), rhs64)
    assert np.linalg.cond(np.tril(m64[0], -1) + np.eye(c)) > 10.0, "ill-conditioned"
    err = rel_rms(ref.unit_lower_solve(m, rhs), want)
    err_ts = rel_rms(solve_triangular(m, rhs, lower=True, unit_diagonal=True), want)
    assert err < max(TOL["solve_vs_fp32_solve"] * err_ts, TOL["solve_floor"]), (err, err_ts)
    with jax.enable_x64(True):
        m64, rhs64 = jnp.asarray(m64), jnp.asarray(rhs64)
        ct = jnp.asarray(np.asarray(normal(k1, rhs.shape), np.float64))
        f = lambda s: lambda m_, r_: jnp.sum(s(m_, r_) * ct)  # noqa: E731
        got = jax.grad(f(ref.unit_lower_solve), (0, 1))(m64, rhs64)
        tri = functools.partial(solve_triangular, lower=True, unit_diagonal=True)
        exp = jax.grad(f(tri), (0, 1))(m64, rhs64)
    for name, a, b in zip(("dm", "drhs"), got, exp, strict=True):
        np.testing.assert_allclose(a, b, **TOL["f64_same_derivative"], err_msg=name)
    np.testing.assert_array_equal(np.triu(np.asarray(got[0])), 0.0)


def test_unit_lower_solve_refuses_widths_off_powers_of_two():
    with pytest.raises(ValueError, match="C = 24: expected a power of two"):
        ref.unit_lower_solve(jnp.eye(24), jnp.ones((24, 4)))


# ----------------------------------------------------------------------------------------------
# chunk_scan
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mm_dtype", [f32, pytest.param(bf16, marks=pytest.mark.slow)])
def test_scan_matches_reference(rng, mm_dtype):
    """The state pass over the reference's own intermediates, from a carried state."""
    inp = _inputs(rng)
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=None, mm_dtype=mm_dtype)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **kw))
    state = inp[7]
    o, s = chunk_scan(inter, state, t=T)
    o_ref, s_ref = ref.chunk_scan_reference(*inter, state, t=T)
    assert o.shape == (B, T, H, K) and s.shape == state.shape
    tol = FP32_TOL if mm_dtype == f32 else TOL["bf16_stage"]
    assert_close(o, o_ref, tol, "chunk_scan o")
    assert_close(s, s_ref, tol, "chunk_scan state")


@pytest.mark.slow
@pytest.mark.parametrize("blk", [ScanBlockSizes(16, 4, 2), ScanBlockSizes(32, 4, 3)])
def test_scan_tilings_match_reference(rng, blk):
    """Both kinds of default tiling (V split into tiles; the whole V in one tile, three stages)
    give the reference's o and state at C = 32 from a carried state. Interpret mode ignores the
    stage count: the compiled cases below run it on a GPU."""
    inp = _inputs(rng)
    kw = dict(scale=K**-0.5, chunk=32, lower_bound=-5.0, mm_dtype=f32)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **kw))
    o, s = chunk_scan(inter, inp[7], t=T, out_dtype=f32, block_sizes=blk)
    o_ref, s_ref = ref.chunk_scan_reference(*inter, inp[7], t=T)
    assert_close(o, o_ref, FP32_TOL, "chunk_scan o")
    assert_close(s, s_ref, FP32_TOL, "chunk_scan state")


def test_scan_rejects_bad_state(rng):
    inp = _inputs(rng)
    inter = chunk_prepare(*_prep_args(inp), scale=K**-0.5, chunk=16, lower_bound=None)
    with pytest.raises(ValueError, match="state has shape"):
        chunk_scan(inter, inp[7][:, :, :-1], t=T)


@pytest.mark.parametrize("pooled", [False, True], ids=["rows", "pool"])
def test_scan_packed_equals_each_sequence_alone(rng, pooled):
    """Packed mode: three sequences on chunks [0, 3), [3, 3) (empty) and [4, 9) of one stream
    of 10 chunks (chunks 3 and 9 held by none), each from its own state: o on its chunks, its
    final state and its prefix states (every 2 chunks) equal the scan of its chunks alone; an
    empty sequence keeps its state's bits; a pool's other slots (and slot -1's) are untouched."""
    c, n_chunks = 16, 10
    inp = _inputs(rng, b=1, t=n_chunks * c, poison=False)
    kw = dict(scale=K**-0.5, chunk=c, lower_bound=None, mm_dtype=f32)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **kw))
    ranges, counts = [(0, 3), (3, 3), (4, 9)], [1, 0, 2]
    base = np.concatenate([[0], np.cumsum(counts)])[:-1]
    info = [(lo, hi, b, n) for (lo, hi), b, n in zip(ranges, base, counts, strict=True)]
    info = jnp.asarray(info, jnp.int32)
    states = normal(jax.random.fold_in(rng, 1), (5 if pooled else 3, H, K, K), scale=0.5)
    slots = jnp.asarray([4, -1, 1], jnp.int32) if pooled else None
    o, new, pre = chunk_scan(
        inter, states, slots, t=n_chunks * c, seq_info=info, prefix_chunks=2, prefix_rows=4
    )
    assert pre.shape == (4, H, K, K)

    def alone(i, lo, hi):
        part = ChunkIntermediates(
            *(a[:, :, lo * c : hi * c] for a in inter[:5]), inter.gl[:, :, lo:hi]
        )
        at = i if slots is None else int(slots[i])
        return ref.chunk_scan_reference(*part, states[at : at + 1], t=(hi - lo) * c)

    for i, (lo, hi) in enumerate(ranges):
        row = i if slots is None else int(slots[i])
        if lo == hi:
            if row >= 0:
                np.testing.assert_array_equal(new[row], states[row], err_msg="empty sequence")
            continue
        o_ref, s_ref = alone(i, lo, hi)
        assert_close(o[:, lo * c : hi * c], o_ref, FP32_TOL, f"sequence {i} o")
        if row >= 0:
            assert_close(new[row : row + 1], s_ref, FP32_TOL, f"sequence {i} state")
        for j in range(counts[i]):
            _, s_j = alone(i, lo, lo + 2 * (j + 1))
            assert_close(pre[base[i] + j][None], s_j, FP32_TOL, f"sequence {i} prefix {j}")
    if pooled:
        for row in (0, 2, 3):
            np.testing.assert_array_equal(new[row], states[row], err_msg=f"slot {row} untouched")


def test_scan_packed_rejects_bad_info(rng):
    inp = _inputs(rng, b=1, t=64, poison=False)
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=None, mm_dtype=f32)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **kw))
    info = jnp.zeros((2, 4), jnp.int32)
    states = jnp.zeros((2, H, K, K))
    with pytest.raises(ValueError, match=r"seq_info of shape \(2, 3\)"):
        chunk_scan(inter, states, t=64, seq_info=info[:, :3])
    with pytest.raises(ValueError, match=r"state has shape \(3, 2, 32, 32\), expected \(2,"):
        chunk_scan(inter, jnp.zeros((3, H, K, K)), t=64, seq_info=info)
    with pytest.raises(ValueError, match="prefix_chunks=2 and prefix_rows=0"):
        chunk_scan(inter, states, t=64, seq_info=info, prefix_chunks=2)
    with pytest.raises(ValueError, match="prefix states need packed mode"):
        chunk_scan(inter, inp[6], t=64, prefix_chunks=2, prefix_rows=1)


# ----------------------------------------------------------------------------------------------
# prefill_core
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lower_bound", [pytest.param(None, marks=pytest.mark.slow), -5.0], ids=["unbounded", "bounded"]
)
def test_prefill_core_matches_reference_and_token_loop(rng, lower_bound):
    inp = _inputs(rng)
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=lower_bound, eps=EPS, out_dtype=f32)
    y, s = prefill_core(*inp, **kw)
    y_ref, s_ref = ref.prefill_core_reference(*inp, **kw)
    assert y.shape == (B, T, H * K) and y.dtype == f32
    assert_close(y, y_ref, FP32_TOL, "prefill_core y vs reference")
    assert_close(s, s_ref, FP32_TOL, "prefill_core state vs reference")
    y_loop, s_loop = _token_loop(inp, lower_bound=lower_bound)
    assert_close(y, y_loop, FP32_TOL, "prefill_core y vs token loop")
    assert_close(s, s_loop, FP32_TOL, "prefill_core state vs token loop")
    pads = jnp.arange(T)[None, :] >= inp[8][:, None]
    assert bool(jnp.all(jnp.where(pads[..., None], y == 0, True))), "pad outputs must be 0"


@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
def test_prefill_core_nan_state_rows(rng, pooled):
    """Rows flagged by nan_state end with a NaN state written by the scan itself (at their slot
    in a pool); the other rows and the untouched slots equal the reference's, and y is unchanged."""
    inp = list(_inputs(rng))
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=-5.0, eps=EPS, out_dtype=f32)
    flags = jnp.array([True] + [False] * (B - 1))
    if pooled:
        pool = normal(jax.random.fold_in(rng, 1), (B + 3, H, K, K), scale=0.1)
        inp[7] = pool
        kw["slots"] = jnp.arange(B, dtype=jnp.int32)[::-1] + 2  # row b at slot B + 1 - b
    y, s = prefill_core(*inp, **kw, nan_state=flags)
    y_plain, s_plain = prefill_core(*inp, **kw)
    y_ref, s_ref = ref.prefill_core_reference(*inp, **kw, nan_state=flags)
    np.testing.assert_array_equal(y, y_plain, err_msg="nan_state changes no output")
    at = np.asarray(kw["slots"]) if pooled else np.arange(B)
    assert bool(jnp.isnan(s[at[0]]).all()) and bool(jnp.isnan(s_ref[at[0]]).all())
    others = np.setdiff1d(np.arange(s.shape[0]), at[:1])
    np.testing.assert_array_equal(s[others], s_plain[others], err_msg="unflagged rows, other slots")
    assert_close(s[others], s_ref[others], FP32_TOL, "unflagged rows vs reference")
    prep = dict(scale=K**-0.5, chunk=16, lower_bound=-5.0, mm_dtype=f32)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **prep))
    with pytest.raises(ValueError, match=r"nan_state of shape \(1,\): expected \[2\]"):
        chunk_scan(inter, inp[7], kw.get("slots"), t=T, nan_state=flags[:1])


def test_prefill_core_strong_decay_vs_token_loop(rng):
    """chunk 64, unbounded gate, log-decay down to about -50 per token: finite, equals the loop."""
    inp = _inputs(rng, decay="strong")
    kw = dict(scale=K**-0.5, chunk=64, lower_bound=None, eps=EPS, out_dtype=f32)
    y, s = prefill_core(*inp, **kw)
    _assert_finite(y, s)
    y_loop, s_loop = _token_loop(inp, lower_bound=None)
    assert_close(y, y_loop, FP32_TOL, "strong decay y")
    assert_close(s, s_loop, FP32_TOL, "strong decay state")


@pytest.mark.slow
def test_prefill_core_split_equals_whole(rng):
    """Prefill of T tokens == prefill of the first half, then of the rest from the carried state."""
    inp = _inputs(rng, b=1, lengths=[T], poison=False)
    q, k, v, f, beta, g_a, g_b, state, lengths, a_log, dt_bias, w = inp
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=None, eps=EPS, out_dtype=f32)
    y, s = prefill_core(*inp, **kw)
    cut = 21
    first = lambda x: x[:, :cut]  # noqa: E731
    rest = lambda x: x[:, cut:]  # noqa: E731
    tail = lambda s_, n: (g_b, s_, jnp.asarray([n]), a_log, dt_bias, w)  # noqa: E731
    y1, s1 = prefill_core(*map(first, (q, k, v, f, beta, g_a)), *tail(state, cut), **kw)
    y2, s2 = prefill_core(*map(rest, (q, k, v, f, beta, g_a)), *tail(s1, T - cut), **kw)
    assert_close(jnp.concatenate([y1, y2], axis=1), y, FP32_TOL, "split y")
    assert_close(s2, s, FP32_TOL, "split state")


@pytest.mark.slow
def test_chunk_kda_zero_length_keeps_state(rng):
    inp = _inputs(rng, lengths=[0, 5])
    q, k, v, f, beta, _, _, state, lengths, a_log, dt_bias, _ = inp
    o, s = chunk_kda(
        q,
        k,
        v,
        f,
        beta,
        state,
        lengths,
        a_log,
        dt_bias,
        scale=K**-0.5,
        chunk=16,
        lower_bound=None,
        mm_dtype=f32,
    )
    _assert_finite(o, s)
    np.testing.assert_array_equal(np.asarray(s[0]), np.asarray(state[0]))
    assert bool(jnp.all(o[0] == 0))


# ----------------------------------------------------------------------------------------------
# chunk_kda_vjp: the chunked core the pallas backend differentiates
# ----------------------------------------------------------------------------------------------
def _core_vjp_case(rng, *, b, t, h, kd, vd, decay):
    """Inputs of `chunk_kda_reference` (L2-normalised q, k; g = -decay * U(0, 1); a random
    carried state) and random cotangents of o and the final state."""
    ks = jax.random.split(rng, 8)
    l2 = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    args = (
        l2(normal(ks[0], (b, t, h, kd))),
        l2(normal(ks[1], (b, t, h, kd))),
        normal(ks[2], (b, t, h, vd)),
        -decay * jax.random.uniform(ks[3], (b, t, h, kd)),
        jax.nn.sigmoid(normal(ks[4], (b, t, h))),
        0.3 * normal(ks[5], (b, h, kd, vd)),
    )
    return args, (normal(ks[6], (b, t, h, vd)), normal(ks[7], (b, h, kd, vd)))


@pytest.mark.parametrize(
    "chunk, kd, vd, decay",
    [
        (16, 32, 32, 0.5),
        (32, 64, 32, 3.0),
        pytest.param(32, 32, 64, 30.0, marks=pytest.mark.slow),
        pytest.param(64, 32, 32, 3.0, marks=pytest.mark.slow),
    ],
    ids=["c16-moderate", "c32-k64-strong", "c32-v64-very-strong", "c64-four-row-blocks"],
)  # fmt: skip
def test_core_vjp_matches_reference(rng, chunk, kd, vd, decay):
    """o, the final state and the gradients of q, k, v, g, beta and the carried state against
    `jax.grad` of `chunk_kda_reference`; T off the chunk grid (its rows past T get no
    cotangent); K = 64 and V = 64 take two slices of the backward kernel; decay 30 a token
    puts exp(G) far below fp32's range within a chunk; C = 64 has four 16-row blocks, so a
    block's dk gathers the score walks of several blocks below it."""
    args, (do, ds) = _core_vjp_case(rng, b=2, t=2 * chunk + 5, h=2, kd=kd, vd=vd, decay=decay)
    scale = kd**-0.5

    def run(fn, *a):
        return fn(*a, scale=scale, chunk=chunk)

    got, pull = jax.vjp(functools.partial(run, chunk_kda_vjp), *args)
    want, pull_ref = jax.vjp(functools.partial(run, ref.chunk_kda_reference), *args)
    for name, g, w in zip(("o", "state"), got, want, strict=True):
        assert_close(g, w, FP32_TOL, name)
    names = ("q", "k", "v", "g", "beta", "initial state")
    for name, g, w in zip(names, pull((do, ds)), pull_ref((do, ds)), strict=True):
        _assert_finite(g)
        assert_close(g, w, FP32_TOL, f"d{name}")


def test_core_vjp_rejects_bad_inputs(rng):
    args, _ = _core_vjp_case(rng, b=1, t=20, h=1, kd=32, vd=32, decay=0.5)
    with pytest.raises(ValueError, match="q is bfloat16, expected float32"):
        chunk_kda_vjp(args[0].astype(bf16), *args[1:], scale=1.0, chunk=16)
    with pytest.raises(ValueError, match="chunk=24; expected a power of two >= 16"):
        chunk_kda_vjp(*args, scale=1.0, chunk=24)


def test_scan_save_states_refuses_pools(rng):
    inp = _inputs(rng)
    kw = dict(scale=K**-0.5, chunk=16, lower_bound=None, mm_dtype=f32)
    inter = ChunkIntermediates(*ref.chunk_prepare_reference(*_prep_args(inp), **kw))
    with pytest.raises(ValueError, match="save_states takes dense rows"):
        chunk_scan(inter, inp[7], jnp.arange(B), t=T, save_states=True)


@pytest.mark.parametrize(
    "chunk, kd, decay",
    [(32, K, 0.3), (16, 16, 0.3), pytest.param(64, 64, 20.0, marks=pytest.mark.slow)],
    ids=["c32-k32", "c16-k16", "c64-k64-strong"],
)  # fmt: skip
def test_chunk_scores_match_reference(rng, chunk, kd, decay):
    """Both score matrices against `reference._chunk_scores`, g a chunk-local cumsum of
    log-decays (K = 16 is narrower than one K slice; K = 64 takes two; C = 64 has blocks two
    and three left of the diagonal); strong decay puts exp(g) far past fp32's range (only
    differences are safe)."""
    ks = jax.random.split(rng, 3)
    q, k = normal(ks[0], (2, 3, chunk, kd)), normal(ks[1], (2, 3, chunk, kd))
    g = jnp.cumsum(-decay * jnp.exp(normal(ks[2], (2, 3, chunk, kd))), axis=-2)
    a, s = chunk_scores(q, k, g)
    assert_close(a, ref._chunk_scores(q, k, g, False), FP32_TOL, "S(q, k)")
    assert_close(s, ref._chunk_scores(k, k, g, True), FP32_TOL, "S_strict(k, k)")


def test_chunk_scores_reject_bad_shapes(rng):
    x = normal(rng, (2, 24, K))
    with pytest.raises(ValueError, match="C=24, K=32: expected C a multiple of 16 and K"):
        chunk_scores(x, x, x)
    with pytest.raises(ValueError, match="chunk_scores: g is bfloat16, expected float32"):
        chunk_scores(x[:, :16], x[:, :16], x[:, :16].astype(jnp.bfloat16))


@pytest.mark.parametrize("chunk", [32, 64])
def test_core_vjp_lowers_for_h200(chunk):
    """The chunked core's gradient at Kimi-Linear heads, T off the chunk grid, builds the Triton
    IR of every kernel it runs."""
    b, t, h, kd = 1, 300, 32, 128
    a = jax.ShapeDtypeStruct((b, t, h, kd), f32)
    args = (a, a, a, a, jax.ShapeDtypeStruct((b, t, h), f32))
    args += (jax.ShapeDtypeStruct((b, h, kd, kd), f32),)

    def loss(*x):
        o, st = chunk_kda_vjp(*x, scale=kd**-0.5, chunk=chunk, interpret=False)
        return jnp.sum(o * o) + jnp.sum(st)

    text = lower_for_h200(jax.grad(loss, argnums=tuple(range(6))), *args)
    for name in ("scores", "scan", "scan_bwd", "local_bwd", "scores_bwd"):
        assert f'"kda_chunk_{name}"' in text, name


# ----------------------------------------------------------------------------------------------
# Cross-lowering for an H200 (real Triton IR, no GPU needed)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
def test_prefill_core_lowers_for_h200(lower_bound, chunk):
    """Kimi-Linear sizes (H=32, K=V=128), bf16, both diagonal paths, T off the chunk grid; the
    scan launches with its default tiling for the chunk width."""
    b, t, h, kd = 2, 300, 32, 128  # N*C = 320: whole-sequence blocks need not be powers of two
    s = jax.ShapeDtypeStruct
    args = (
        *(s((b, t, h, kd), bf16),) * 3,
        s((b, t, h * kd), bf16),
        s((b, t, h), bf16),
        s((b, t, kd), bf16),
        s((h * kd, kd), bf16),
        s((b, h, kd, kd), f32),
        s((b,), jnp.int32),
        s((h,), f32),
        s((h * kd,), f32),
        s((kd,), f32),
    )
    fn = lambda *a: prefill_core(  # noqa: E731
        *a,
        scale=kd**-0.5,
        chunk=chunk,
        lower_bound=lower_bound,
        eps=EPS,
        out_dtype=bf16,
        interpret=False,
    )
    text = lower_for_h200(fn, *args)
    for name in ("kda_chunk_prepare", "kda_chunk_scan", "kda_o_norm_gate"):
        assert name in text, name
    blk = ScanBlockSizes.get_default(b, h, kd, chunk)
    launch = f'"kda_chunk_scan", num_stages = {blk.num_stages} : i32, num_warps = {blk.num_warps}'
    assert launch in text


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
def test_prepare_lowers_for_h200(lower_bound):
    """chunk_prepare at Kimi-Linear sizes (H=32, K=V=128, C=64), bf16, fused L2 norm, T off the
    chunk grid: the real Triton IR of its three kernels builds."""
    b, t, h, kd = 2, 300, 32, 128
    s = jax.ShapeDtypeStruct
    args = (
        *(s((b, t, h, kd), bf16),) * 3,
        s((b, t, h * kd), bf16),
        s((b, t, h), bf16),
        s((b,), jnp.int32),
        s((h,), f32),
        s((h * kd,), f32),
    )
    fn = lambda *a: chunk_prepare(  # noqa: E731
        *a,
        scale=kd**-0.5,
        chunk=64,
        lower_bound=lower_bound,
        mm_dtype=bf16,
        l2_eps=1e-6,
        interpret=False,
    )
    text = lower_for_h200(fn, *args)
    for name in ("kda_chunk_diag", "kda_chunk_prepare", "kda_chunk_wu"):
        assert name in text, name


# ----------------------------------------------------------------------------------------------
# Compiled on a GPU: the production bf16 path at T = 4096, Kimi-Linear heads
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu(reason="compiled-kernel accuracy at T=4096 needs a GPU")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("decay", ["moderate", "weak"])
@pytest.mark.parametrize("chunk", [32, 64])
def test_prefill_core_bf16_t4096_on_gpu(rng, lower_bound, decay, chunk):
    t, h, kd = 4096, 32, 128
    inp = _inputs(rng, b=2, t=t, h=h, kd=kd, dtype=bf16, decay=decay, lengths=[t, t - 77])
    kw = dict(scale=kd**-0.5, chunk=chunk, lower_bound=lower_bound, eps=EPS)
    y, s = prefill_core(*inp, **kw, out_dtype=bf16)
    _assert_finite(y, s)
    y_ref, s_ref = ref.prefill_core_reference(*inp, **kw, out_dtype=f32)
    err_y = assert_close(y, y_ref, TOL["bf16_stage"], "y vs fp32 reference")
    err_s = assert_close(s, s_ref, TOL["bf16_stage"], "state vs fp32 reference")
    print(f"bf16 prefill_core T={t} C={chunk}: rel RMS y {err_y:.2e}, state {err_s:.2e}")


@pytest.mark.gpu(reason="compiled-kernel check needs a GPU")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("chunk", [32, 64])
def test_prefill_core_strong_decay_on_gpu(rng, lower_bound, chunk):
    t, h, kd = 1024, 32, 128
    inp = _inputs(rng, b=1, t=t, h=h, kd=kd, dtype=bf16, decay="strong", lengths=[t - 5])
    kw = dict(scale=kd**-0.5, chunk=chunk, lower_bound=lower_bound, eps=EPS)
    y, s = prefill_core(*inp, **kw, out_dtype=bf16)
    _assert_finite(y, s)
    y_ref, s_ref = ref.prefill_core_reference(*inp, **kw, out_dtype=f32)
    assert_close(y, y_ref, TOL["bf16_stage"], "strong decay y")
    assert_close(s, s_ref, TOL["bf16_stage"], "strong decay state")


@pytest.mark.gpu(reason="compiled stage checks need a GPU")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("chunk", [32, 64])
def test_stages_fp32_on_gpu(rng, lower_bound, chunk):
    """Each compiled stage in fp32 (TF32 products) against its reference, Kimi-Linear heads,
    both gates (the prepare kernels' barriers and masks only show compiled)."""
    t, h, kd = 300, 4, 128
    inp = _inputs(rng, b=2, t=t, h=h, kd=kd, lengths=[t, 131])
    args = _prep_args(inp)
    kw = dict(scale=kd**-0.5, chunk=chunk, lower_bound=lower_bound, mm_dtype=f32)
    got = chunk_prepare(*args, **kw)
    want = ChunkIntermediates(*ref.chunk_prepare_reference(*args, **kw))
    for name in ChunkIntermediates._fields:
        assert_close(getattr(got, name), getattr(want, name), FP32_TOL, name)
    o, s = chunk_scan(want, inp[7], t=t)
    o_ref, s_ref = ref.chunk_scan_reference(*want, inp[7], t=t)
    assert_close(o, o_ref, FP32_TOL, "scan o")
    assert_close(s, s_ref, FP32_TOL, "scan state")


@pytest.mark.gpu(reason="compiled-kernel accuracy at T=4096 needs a GPU")
@pytest.mark.parametrize("decay", [0.05, 1.0, 20.0], ids=["weak", "moderate", "strong"])
def test_core_vjp_t4096_on_gpu(rng, decay):
    """The compiled core's gradients (TF32 products) over 128 chunks of Kimi-Linear heads,
    T one row off the chunk grid, against `jax.grad` of the reference (XLA, HIGHEST)."""
    t, kd = 4095, 128
    args, cts = _core_vjp_case(rng, b=2, t=t, h=4, kd=kd, vd=kd, decay=decay)

    def run(fn, *a):
        return fn(*a, scale=kd**-0.5, chunk=32)

    got, pull = jax.vjp(functools.partial(run, chunk_kda_vjp), *args)
    with jax.default_matmul_precision("highest"):
        want, pull_ref = jax.vjp(functools.partial(run, ref.chunk_kda_reference), *args)
        grads_ref = pull_ref(cts)
    for name, g, w in zip(("o", "state"), got, want, strict=True):
        assert_close(g, w, TOL["fp32_gpu"], name)
    names = ("q", "k", "v", "g", "beta", "initial state")
    for name, g, w in zip(names, pull(cts), grads_ref, strict=True):
        assert_close(g, w, TOL["fp32_gpu"], f"d{name}")
