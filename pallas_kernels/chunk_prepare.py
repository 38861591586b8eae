"""Intra-chunk stage of the chunked prefill (SPEC §5, steps 1-3): everything that needs no state.

One program per (sequence, chunk, head) reads the chunk's q, k, v, raw gate input f and beta
logits, and writes what the state pass (`chunk_scan`) needs, so that pass does four matrix
products per chunk and nothing else:

    g       = gate(f), beta = sigmoid(b)         0 at pads (t >= lengths[b]), whatever they hold
    G       = chunk-local inclusive cumsum of g  [C, K] fp32, G <= 0, decreasing
    A[i,j]  = s sum_d q_i k_j exp(G_i - G_j)     j <= i          (q-k scores)
    L[i,j]  = beta_i sum_d k_i k_j exp(G_i - G_j) j < i          (k-k, strictly lower)
    T       = (I + L)^-1
    w       = T (beta * k * exp(G)),  u = T (beta * v)
    qg      = s q exp(G),  kg = k exp(G_last - G),  gl = exp(G_last)

Streaming: the kernel walks the K (and V) columns in slices of `block_k` and keeps only the
[sub, sub] score and inverse tiles across slices, so registers never hold the [C, K] chunk
(holding it spilled to local memory and cost 5x in the first version). The sums over K of the
scores accumulate slice by slice; the gate and its cumulative sum are recomputed per slice from
f when w needs them again.

Decay safety (SPEC §5, overflow hazard): every exponent evaluated is <= 0. The chunk is cut into
sub-blocks of `sub` rows, with block-local cumulative sums Gl_i and block totals S_i
(G = S_0 + .. + S_{i-1} + Gl_i). With the unbounded gate a diagonal sub-block is computed
pairwise as a [sub, sub, block_k] tile, the mask applied before `exp`. With a bounded gate whose
sub-block span stays far from overflow ((sub - 1) |lb| <= 80 nats, e.g. lb = -5) the diagonal
factorises around its middle row instead (one product). An off-diagonal tile (row block i >
column block j) factorises as exp(G_a - G_b) = exp(Gl_a) exp(S_{j+1} + .. + S_{i-1})
exp(S_j - Gl_b): three exponents <= 0, no differences of large cumulative sums.
T is built block by block: the diagonal [sub, sub] inverses as (I - L)(I + L^2)(I + L^4)(I + L^8)
plus one Newton step (as accurate as an fp32 triangular solve, measured against float64), the
off-diagonal blocks by T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ (full fp32 dots, no TF32).
Only the products that feed the state pass (scores, w, u) use the default (TF32) precision.

Layouts (written chunk-major per (sequence, head), the order `chunk_scan` walks them):
  qg, kg, w: [B, H, N*C, K] mm_dtype;  u: [B, H, N*C, V] fp32 (the state pass subtracts from it);
  a: [B, H, N*C, C] mm_dtype (zeros above the diagonal);  gl: [B, H, N, K] fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.gate import beta_math, gate_math

__all__ = ["ChunkIntermediates", "PrepareBlockSizes", "chunk_prepare"]

f32 = jnp.float32
HI = lax.Precision.HIGHEST
# Largest masked-out exponent the factorised diagonal may form (fp32 exp overflows past 88).
_FACTORISED_MAX_NATS = 80.0


class ChunkIntermediates(NamedTuple):
    """What `chunk_prepare` hands to `chunk_scan` (layouts in the module docstring)."""

    qg: jax.Array  # [B, H, N*C, K]  s q exp(G)
    kg: jax.Array  # [B, H, N*C, K]  k exp(G_last - G)
    w: jax.Array  # [B, H, N*C, K]  T (beta k exp(G))
    u: jax.Array  # [B, H, N*C, V]  T (beta v), fp32
    a: jax.Array  # [B, H, N*C, C]  masked q-k scores, zeros above the diagonal
    gl: jax.Array  # [B, H, N, K]    exp(G_last), fp32


@dataclasses.dataclass(frozen=True)
class PrepareBlockSizes:
    """Tiling of `chunk_prepare`.

    Attributes:
      sub: rows of a sub-block (16: the smallest Triton dot side); divides the chunk.
      block_k: width of the K (and V) column slices the kernel streams through; a power of two
        >= 16 dividing K and V. Every per-slice temporary is [sub, block_k] (the unbounded
        diagonal's [sub, sub, block_k]), so registers hold the score accumulators, not the chunk.
      num_warps: Triton warps per program.
    """

    sub: int = 16
    block_k: int = 32
    num_warps: int = 4

    @staticmethod
    def default_for(head_dim: int, v_dim: int) -> PrepareBlockSizes:
        return PrepareBlockSizes(sub=16, block_k=min(32, head_dim, v_dim), num_warps=4)


def _rows_and_cols(n: int):
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return rows, cols


def _needs_pairwise(lower_bound: float | None, sub: int) -> bool:
    """Whether diagonal sub-blocks must be computed pairwise (unbounded or strong bounded gate)."""
    return lower_bound is None or (sub - 1) * abs(lower_bound) > _FACTORISED_MAX_NATS


def _diag_pairwise(q, k, gl):
    """Scores of one diagonal sub-block over one column slice, every pair on its own.

    q, k, gl: [sub, bk] (gl = block-local cumulative log-decay). Returns (sum_d q_i k_j e_ijd,
    sum_d k_i k_j e_ijd) [sub, sub] with e_ijd = exp(gl_id - gl_jd) for j <= i and 0 above: the
    mask is applied before `exp`, so no exponent is positive at any decay strength.
    """
    sub = q.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (sub, sub, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (sub, sub, 1), 1)
    e = jnp.exp(jnp.where(rows >= cols, gl[:, None, :] - gl[None, :, :], -jnp.inf))
    ke = k[None, :, :] * e
    return jnp.sum(q[:, None, :] * ke, axis=2), jnp.sum(k[:, None, :] * ke, axis=2)


def _diag_factorised(q, k, gl):
    """The same scores by one product each, factorised around the middle row m of the block.

    Only for a bounded gate with (sub - 1) * |lb| <= _FACTORISED_MAX_NATS: a factor's exponent is
    then at most sub/2 * |lb| and a masked-out product at most (sub - 1) * |lb|, far from fp32
    overflow (88 nats); the kept entries are exactly exp(G_i - G_j) <= 1. Entries above the
    diagonal are garbage (finite) and masked by the caller.
    """
    sub = q.shape[0]
    row_ids = lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
    g_m = jnp.sum(jnp.where(row_ids == sub // 2, gl, 0.0), axis=0, keepdims=True)  # [1, bk]
    to_m, from_m = jnp.exp(gl - g_m), jnp.exp(g_m - gl)
    kd = k * from_m
    return _dot_nt(q * to_m, kd), _dot_nt(k * to_m, kd)


def _dot_nt(x, y, precision=None):
    """x @ y.T with fp32 accumulation."""
    return lax.dot_general(
        x, y, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32
    )


def _unit_lower_inverse(lmat, *, sub: int):
    """(I + L)^-1 of a strictly lower [sub, sub] L: (I - L)(I + L^2)(I + L^4)...(I + L^(sub/2)).

    L^sub = 0, so the product is exact algebra; the dots run in full fp32 (no TF32). Measured
    against a float64 solve in tests/test_chunk.py.
    """
    rows, cols = _rows_and_cols(sub)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(f32)
    dot = functools.partial(jnp.dot, precision=HI, preferred_element_type=f32)
    inv, power, m = eye - lmat, lmat, 2
    while m < sub:
        power = dot(power, power)  # L^m
        inv = dot(inv, eye + power)
        m *= 2
    # One Newton step, X <- X + X (I - (I + L) X), squares the product form's rounding error.
    return inv + dot(inv, eye - dot(eye + lmat, inv))


def _chunk_prepare_kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    f_ref,
    b_ref,
    ea_ref,
    dt_ref,
    qg_ref,
    kg_ref,
    w_ref,
    u_ref,
    a_ref,
    gl_ref,
    *,
    scale: float,
    lower_bound: float | None,
    l2_eps: float | None,
    sub: int,
    block_k: int,
):
    """One (sequence, chunk, head).

    len_ref: [Bp] int32; q_ref, k_ref, f_ref: [C, K]; v_ref: [C, V]; b_ref: [C]; ea_ref (exp A_log
    broadcast over K), dt_ref: [K]. Outputs: qg_ref, kg_ref, w_ref: [C, K]; u_ref: [C, V];
    a_ref: [C, C]; gl_ref: [1, K].

    Sub-block i holds rows i*sub..; per column slice, Gl_i is its block-local cumulative
    log-decay and S_i = Gl_i's last row (the block's total), so G = (S_0 + .. + S_{i-1}) + Gl_i.
    Every exponential below is of a sum of such terms that is <= 0.
    """
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    nb, bk = c // sub, block_k
    seq, chunk_idx = pl.program_id(0), pl.program_id(1)
    length = len_ref[seq]
    offs = lax.broadcasted_iota(jnp.int32, (sub,), 0)
    valid = [chunk_idx * c + i * sub + offs < length for i in range(nb)]  # [sub] per block
    last_row = lax.broadcasted_iota(jnp.int32, (sub, 1), 0) == sub - 1
    pairwise = _needs_pairwise(lower_bound, sub)
    k_slices = [pl.ds(s * bk, bk) for s in range(kd // bk)]
    v_slices = [pl.ds(s * bk, bk) for s in range(vd // bk)]

    def rows(i):
        return pl.ds(i * sub, sub)

    def load(ref, i, cols):
        """[sub, bk] fp32 of block i, 0 at pads and past T (whatever the pads hold)."""
        x = plt.load(ref.at[rows(i), cols], mask=valid[i][:, None], other=0.0)
        return x.astype(f32)

    # L2 norms of q and k per row (FLA's use_qk_l2norm_in_kernel), applied to each slice.
    if l2_eps is None:
        rq = rk = [1.0] * nb
    else:
        rq, rk = [], []
        for i in range(nb):
            sq = sum(
                jnp.sum(jnp.square(load(q_ref, i, s)), axis=1, keepdims=True) for s in k_slices
            )
            sk = sum(
                jnp.sum(jnp.square(load(k_ref, i, s)), axis=1, keepdims=True) for s in k_slices
            )
            rq.append(lax.rsqrt(sq + l2_eps))
            rk.append(lax.rsqrt(sk + l2_eps))
    beta = []
    for i in range(nb):
        b_i = beta_math(plt.load(b_ref.at[rows(i)], mask=valid[i], other=0.0))
        beta.append(jnp.where(valid[i], b_i, 0.0)[:, None])

    def decay(i, cols):
        """(Gl_i, S_i) over a column slice: gate of block i (0 at pads), local cumsum, total."""
        ea = ea_ref[cols].astype(f32)[None, :]
        dt = dt_ref[cols].astype(f32)[None, :]
        g = jnp.where(valid[i][:, None], gate_math(load(f_ref, i, cols) + dt, ea, lower_bound), 0.0)
        gl = jnp.cumsum(g, axis=0)
        return gl, jnp.sum(jnp.where(last_row, gl, 0.0), axis=0, keepdims=True)

    # 1-2. Scores, accumulated over the column slices. A_ij (j <= i) and L_ij (j < i) per pair
    # of sub-blocks; an off-diagonal pair (i > j) factorises as exp(G_i - G_j) =
    # exp(Gl_i) exp(S_{j+1} + .. + S_{i-1}) exp(S_j - Gl_j). qg and kg are written on the way.
    acc_a, acc_l = {}, {}

    def add(acc, key, x):
        acc[key] = x if key not in acc else acc[key] + x

    for cols in k_slices:
        tots, kts = [], []
        cum = jnp.zeros((1, bk), f32)  # G at the end of the previous block
        for i in range(nb):
            gl, tot = decay(i, cols)
            q = load(q_ref, i, cols) * rq[i]
            k = load(k_ref, i, cols) * rk[i]
            qg_ref[rows(i), cols] = (scale * q * jnp.exp(cum + gl)).astype(qg_ref.dtype)
            eg = jnp.exp(gl)
            qd, kd_ = q * eg, k * eg
            between = None  # S_{j+1} + .. + S_{i-1}
            for j in range(i - 1, -1, -1):
                if j < i - 1:
                    between = tots[j + 1] if between is None else between + tots[j + 1]
                scaled = (
                    (qd, kd_)
                    if between is None
                    else (qd * jnp.exp(between), kd_ * jnp.exp(between))
                )
                add(acc_a, (i, j), _dot_nt(scaled[0], kts[j]))
                add(acc_l, (i, j), _dot_nt(scaled[1], kts[j]))
            diag = _diag_pairwise if pairwise else _diag_factorised
            qk, kk = diag(q, k, gl)
            add(acc_a, (i, i), qk)
            add(acc_l, (i, i), kk)
            tots.append(tot)
            kts.append(k * jnp.exp(tot - gl))
            cum = cum + tot
        gl_ref[:, cols] = jnp.exp(cum)
        after = jnp.zeros((1, bk), f32)  # S_{i+1} + .. + S_{nb-1}
        for i in range(nb - 1, -1, -1):
            kg_ref[rows(i), cols] = (kts[i] * jnp.exp(after)).astype(kg_ref.dtype)
            after = after + tots[i]

    rws, cls = _rows_and_cols(sub)
    l_t = {}
    for i in range(nb):
        for j in range(nb):
            a_ij = jnp.zeros((sub, sub), f32)
            if j < i:
                a_ij = scale * acc_a[i, j]
                l_t[i, j] = beta[i] * acc_l[i, j]
            elif j == i:
                a_ij = jnp.where(rws >= cls, scale * acc_a[i, i], 0.0)
                l_t[i, i] = beta[i] * jnp.where(rws > cls, acc_l[i, i], 0.0)
            a_ref[rows(i), pl.ds(j * sub, sub)] = a_ij.astype(a_ref.dtype)

    # 3. T = (I + L)^-1 by sub-blocks: T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ.
    t_t = {(i, i): _unit_lower_inverse(l_t[i, i], sub=sub) for i in range(nb)}
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = sum(
                jnp.dot(l_t[i, m], t_t[m, j], precision=HI, preferred_element_type=f32)
                for m in range(j, i)
            )
            t_t[i, j] = -jnp.dot(t_t[i, i], acc, precision=HI, preferred_element_type=f32)

    # 4. w = T (beta k exp(G)) and u = T (beta v), slice by slice.
    def apply_t(out_ref, cols, parts):
        for i in range(nb):
            acc = sum(
                jnp.dot(t_t[i, j], parts[j], preferred_element_type=f32) for j in range(i + 1)
            )
            out_ref[rows(i), cols] = acc.astype(out_ref.dtype)

    for cols in k_slices:
        parts, cum = [], jnp.zeros((1, bk), f32)
        for j in range(nb):
            gl, tot = decay(j, cols)
            parts.append(beta[j] * load(k_ref, j, cols) * rk[j] * jnp.exp(cum + gl))
            cum = cum + tot
        apply_t(w_ref, cols, parts)
    for cols in v_slices:
        apply_t(u_ref, cols, [beta[j] * load(v_ref, j, cols) for j in range(nb)])


def _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk):
    bsz, t, h, kd = q.shape
    vd = v.shape[-1]
    want = {
        "k": (k.shape, (bsz, t, h, kd)),
        "v": (v.shape, (bsz, t, h, vd)),
        "f": (f.shape, (bsz, t, h * kd)),
        "b": (b.shape, (bsz, t, h)),
        "lengths": (lengths.shape, (bsz,)),
        "a_log": (a_log.shape, (h,)),
        "dt_bias": (dt_bias.shape, (h * kd,)),
    }
    for name, (got, exp) in want.items():
        if tuple(got) != exp:
            raise ValueError(f"chunk_prepare: {name} has shape {tuple(got)}, expected {exp}")
    for name, n in (("K", kd), ("V", vd), ("chunk", chunk)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"chunk_prepare: {name}={n} must be a power of two >= 16")
    if chunk % blk.sub:
        raise ValueError(f"chunk_prepare: chunk={chunk} must be a multiple of sub={blk.sub}")
    if blk.block_k < 16 or blk.block_k & (blk.block_k - 1) or kd % blk.block_k or vd % blk.block_k:
        raise ValueError(
            f"chunk_prepare: block_k={blk.block_k} must be a power of two >= 16 dividing "
            f"K={kd} and V={vd}"
        )


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "lower_bound", "mm_dtype", "l2_eps"))
def chunk_prepare(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    lengths: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    mm_dtype=jnp.bfloat16,
    l2_eps: float | None = None,
) -> ChunkIntermediates:
    """Gate, cumsum, scores, (I+L)^-1, w and u for every chunk (module docstring).

    Args:
      q, k: [B, T, H, K] L2-normalised (q unscaled); v: [B, T, H, V]; any float dtype.
      f: [B, T, H*K] raw forget-gate input; b: [B, T, H] beta logits.
      lengths: [B] int32 in [0, T]; positions t >= lengths[b] are pads (may hold NaN).
      a_log: [H] fp32; dt_bias: [H*K] fp32.
      scale: s = K^-0.5; chunk: C (power of two >= 16); T need not be a multiple of it.
      lower_bound: lb of the bounded gate, None for the unbounded gate.
      mm_dtype: storage dtype of qg, kg, w, a (bf16 for speed, fp32 for accuracy); u is fp32.
      l2_eps: when set, q and k arrive raw and are L2-normalised here, 1/sqrt(sum + l2_eps)
        per head (FLA's use_qk_l2norm_in_kernel); None: they are normalised already.
    Returns:
      ChunkIntermediates with N = ceil(T / C) chunks per sequence.
    """
    blk = PrepareBlockSizes.default_for(q.shape[-1], v.shape[-1])
    return _chunk_prepare(
        q,
        k,
        v,
        f,
        b,
        lengths,
        a_log,
        dt_bias,
        scale=scale,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=mm_dtype,
        l2_eps=l2_eps,
        blk=blk,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "chunk", "lower_bound", "mm_dtype", "l2_eps", "blk")
)
def _chunk_prepare(
    q, k, v, f, b, lengths, a_log, dt_bias, *, scale, chunk, lower_bound, mm_dtype, l2_eps, blk
) -> ChunkIntermediates:
    """`chunk_prepare` with explicit block sizes (benchmarks sweep them)."""
    _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk)
    bsz, t, h, kd = q.shape
    vd = v.shape[-1]
    n = common.cdiv(t, chunk)
    tp = n * chunk
    lens = jnp.zeros((common.next_pow2(bsz),), jnp.int32).at[:bsz].set(lengths.astype(jnp.int32))
    ea = jnp.broadcast_to(jnp.exp(a_log.astype(f32))[:, None], (h, kd))
    dt = dt_bias.astype(f32).reshape(h, kd)

    tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda s, c, hh: (s, c, hh, 0))  # noqa: E731
    head = pl.BlockSpec((None, kd), lambda s, c, hh: (hh, 0))
    inter = lambda d: pl.BlockSpec((None, None, chunk, d), lambda s, c, hh: (s, hh, c, 0))  # noqa: E731
    out_shape = ChunkIntermediates(
        qg=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        kg=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        w=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        u=jax.ShapeDtypeStruct((bsz, h, tp, vd), f32),
        a=jax.ShapeDtypeStruct((bsz, h, tp, chunk), mm_dtype),
        gl=jax.ShapeDtypeStruct((bsz, h, n, kd), f32),
    )
    out_specs = ChunkIntermediates(
        qg=inter(kd),
        kg=inter(kd),
        w=inter(kd),
        u=inter(vd),
        a=inter(chunk),
        gl=pl.BlockSpec((None, None, 1, kd), lambda s, c, hh: (s, hh, c, 0)),
    )
    kernel = functools.partial(
        _chunk_prepare_kernel,
        scale=scale,
        lower_bound=lower_bound,
        l2_eps=l2_eps,
        sub=blk.sub,
        block_k=blk.block_k,
    )
    res = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            tok(kd),
            tok(kd),
            tok(vd),
            tok(kd),
            pl.BlockSpec((None, chunk, None), lambda s, c, hh: (s, c, hh)),
            head,
            head,
        ],
        out_specs=tuple(out_specs),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=1),
        name="kda_chunk_prepare",
        interpret=common.interpret(),
    )(lens, q, k, v, f.reshape(bsz, t, h, kd), b, ea, dt)
    return ChunkIntermediates(*res)
