"""Pure-jnp references of every kernel, one function per op, same signature as the kernel.

These are also the `xla` backend of `kda_jax`: the block's forward calls them when no GPU
kernel is wanted. Notation (SPEC.md): B sequences, R rows per sequence in one decode call
(1 for decode, k for the verify), T tokens, H heads, K = V = head_dim, P = H*K, W conv width,
C chunk. All state and gate math is fp32; matrix inputs may be bf16 with fp32 accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common

__all__ = [
    "gemv_reference",
    "proj_many_reference",
    "conv_decode_reference",
    "decode_front_reference",
    "conv_prefill_reference",
    "gate_reference",
    "recurrent_reference",
    "o_norm_reference",
    "chunk_kda_reference",
    "fused_recurrent_reference",
    "decode_core_reference",
    "prefill_core_reference",
    "prefill_core_packed_reference",
    "pool_rows",
    "pool_write",
    "slot_fill",
]

f32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Slot-indexed state pools: what the kernels do in place, as gather and scatter
# --------------------------------------------------------------------------------------------
def pool_rows(pool: jax.Array, slots: jax.Array) -> jax.Array:
    """pool [N, ...] at slots [B] -> [B, ...]; a negative slot reads row 0 (never kept)."""
    return jnp.take(pool, jnp.maximum(slots, 0), axis=0)


def pool_write(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """pool with rows[b] written at slots[b] where slots[b] >= 0 (the others write nothing).
    Non-negative slots must be distinct (which of two writes lands is unspecified)."""
    idx = jnp.where(slots >= 0, slots, pool.shape[0])  # out of range: dropped
    return pool.at[idx].set(rows.astype(pool.dtype), mode="drop")


def slot_fill(slots: jax.Array, a: jax.Array) -> jax.Array:
    """a [B, ...] with the rows of negative slots replaced: 0 for -1 (padding), NaN below (a
    row the caller refused)."""
    s = slots.reshape((-1,) + (1,) * (a.ndim - 1))
    return jnp.where(s >= 0, a, jnp.where(s == -1, 0.0, jnp.nan).astype(a.dtype))


# --------------------------------------------------------------------------------------------
# Projections
# --------------------------------------------------------------------------------------------
def gemv_reference(
    x: jax.Array, w: jax.Array, *, out_dtype=None, splits=None, bias=None, precision=None
):
    """y = x @ w.T (+ bias) with fp32 accumulation, cast once.

    Args:
      x: [M, D] activations (M rows; 1 for a single-token GEMV).
      w: [N, D] weight in torch `[out, in]` layout.
      out_dtype: dtype of y (default: w.dtype).
      splits: widths summing to N: return y's column blocks, in order, as a tuple.
      bias: optional [N], added in fp32 before the cast.
      precision: of the dot (None: HIGHEST, IEEE fp32 for fp32 weights).
    Returns:
      [M, N] out_dtype, or a tuple of [M, n_s] when `splits` is given.
    """
    y = lax.dot_general(
        x.astype(w.dtype),
        w,
        (((1,), (1,)), ((), ())),
        preferred_element_type=f32,
        precision=precision or lax.Precision.HIGHEST,
    )
    y = add_bias(y, bias, out_dtype or w.dtype)
    return y if splits is None else split_last(y, splits)


def split_last(y: jax.Array, splits) -> tuple[jax.Array, ...]:
    """y's last axis cut into consecutive blocks of the given widths (which must sum to it)."""
    if sum(splits) != y.shape[-1] or min(splits) < 1:
        raise ValueError(f"splits={tuple(splits)}: expected widths summing to {y.shape[-1]}")
    bounds = common.bounds(splits)
    return tuple(y[..., lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))


def add_bias(y: jax.Array, bias, out_dtype) -> jax.Array:
    """y + bias in fp32 (no bias: y), cast once to out_dtype: how every stage adds a bias."""
    if bias is not None:
        y = y.astype(f32) + bias.astype(f32)
    return y.astype(out_dtype)


def proj_many_biases(biases, ws) -> tuple:
    """`biases` as one entry per weight (None or [N]); None means no bias anywhere."""
    biases = (None,) * len(ws) if biases is None else tuple(biases)
    n = ws[0].shape[0] if len(ws) else 0
    if len(biases) != len(ws) or any(b is not None and b.shape != (n,) for b in biases):
        raise ValueError(
            f"biases: expected {len(ws)} entries, each None or [{n}], got "
            f"{[None if b is None else tuple(b.shape) for b in biases]}"
        )
    return biases


def proj_many_reference(
    xs, ws, *, out_dtype=None, biases=None, precision=None
) -> tuple[jax.Array, ...]:
    """(xs[g] @ ws[g].T + biases[g] for every g), fp32 accumulation: several projections of one
    shape; `biases` is None or one entry (None or [N]) per weight."""
    biases = proj_many_biases(biases, ws)
    return tuple(
        gemv_reference(x, w, out_dtype=out_dtype, bias=b, precision=precision)
        for x, w, b in zip(xs, ws, biases, strict=True)
    )


# --------------------------------------------------------------------------------------------
# Short causal conv + SiLU + per-head L2 of q and k
# --------------------------------------------------------------------------------------------
def _l2_qk(y: jax.Array, *, qk_channels: int, head_dim: int, l2_eps: float) -> jax.Array:
    """L2-normalises each head_dim group of the first qk_channels channels of y [..., C]."""
    qk = y[..., :qk_channels]
    groups = qk.reshape(*qk.shape[:-1], qk_channels // head_dim, head_dim)
    inv = lax.rsqrt(jnp.sum(groups * groups, axis=-1, keepdims=True) + l2_eps)
    qk = (groups * inv).reshape(qk.shape)
    return jnp.concatenate([qk, y[..., qk_channels:]], axis=-1)


def _conv_silu(window: jax.Array, w: jax.Array) -> jax.Array:
    """window [..., W, C] fp32 (oldest first), w [C, W] -> SiLU(sum_j w[:, j] * window[j])."""
    y = jnp.einsum("...jc,cj->...c", window, w, precision=lax.Precision.HIGHEST)
    return y * jax.nn.sigmoid(y)


def conv_decode_reference(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    splits: tuple[int, ...] | None = None,
    snapshots: bool = False,
    slots: jax.Array | None = None,
):
    """Conv step for R new rows per sequence, from the carried conv state.

    Args:
      x: [B, R, C] raw (pre-conv) q|k|v rows, any float dtype.
      conv_state: [B, W-1, C] fp32, the last W-1 raw inputs, oldest first.
      w: [C, W] fp32 taps; w[:, W-1] multiplies the current row.
      splits: channel widths summing to C: return `out` as that many arrays (e.g. q, k, v).
      snapshots: also return the conv state after every row.
      slots: [B] int32 or None: conv_state is then a pool [N, W-1, C], row b reads and writes
        pool row slots[b]; a negative slot writes nothing and its out and states are 0 (-1)
        or NaN (below -1) (`slot_fill`).
    Returns:
      out: [B, R, C] fp32, SiLU(conv) with q and k L2-normalised per head; with `splits`, a
        tuple of [B, R, c_s].
      new_state: [B, W-1, C] fp32, the conv state after the last row (with slots, the pool).
      states: [B, R, W-1, C] fp32, the conv state after each row, or None without `snapshots`.
    """
    if slots is not None:
        out, new_rows, states = conv_decode_reference(
            x,
            pool_rows(conv_state, slots),
            w,
            qk_channels=qk_channels,
            head_dim=head_dim,
            l2_eps=l2_eps,
            splits=splits,
            snapshots=snapshots,
        )
        fill = functools.partial(slot_fill, slots)
        out = fill(out) if splits is None else tuple(map(fill, out))
        states = None if states is None else fill(states)
        return out, pool_write(conv_state, slots, new_rows), states
    wdt = w.shape[1]
    seq = jnp.concatenate([conv_state.astype(f32), x.astype(f32)], axis=1)  # [B, W-1+R, C]
    r = x.shape[1]
    idx = jnp.arange(r)[:, None] + jnp.arange(wdt)[None, :]  # [R, W]
    windows = seq[:, idx]  # [B, R, W, C]
    out = _l2_qk(_conv_silu(windows, w), qk_channels=qk_channels, head_dim=head_dim, l2_eps=l2_eps)
    states = windows[:, :, 1:]
    out = out if splits is None else split_last(out, splits)
    return out, states[:, -1], (states if snapshots else None)


def decode_front_reference(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    xs,
    ws,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    splits: tuple[int, ...] | None = None,
    snapshots: bool = False,
    out_dtype=None,
    slots: jax.Array | None = None,
    biases=None,
    precision=None,
):
    """The decode step's conv and its f_b | g_b projections, which share one launch on the
    kernel path: `conv_decode_reference(x, conv_state, w, ..., slots)` and
    `proj_many_reference(xs, ws, biases=biases)`. Returns (out or its segments, new_state,
    states | None, ys)."""
    out, new_state, states = conv_decode_reference(
        x,
        conv_state,
        w,
        qk_channels=qk_channels,
        head_dim=head_dim,
        l2_eps=l2_eps,
        splits=splits,
        snapshots=snapshots,
        slots=slots,
    )
    ys = proj_many_reference(xs, ws, out_dtype=out_dtype, biases=biases, precision=precision)
    return out, new_state, states, ys


def conv_prefill_reference(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    lengths: jax.Array,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    out_dtype=jnp.float32,
    splits: tuple[int, ...] | None = None,
):
    """Causal conv over T padded tokens from the carried conv state.

    Args:
      x: [B, T, C] raw q|k|v; positions t >= lengths[b] may hold anything (NaN included).
      conv_state: [B, W-1, C] fp32.
      w: [C, W] fp32.
      lengths: [B] int32, real tokens per row (0 <= lengths <= T).
      splits: channel widths summing to C: return `out` as that many arrays (e.g. q, k, v).
    Returns:
      out: [B, T, C] out_dtype, SiLU(conv) with q, k L2-normalised, exactly 0 at pad positions;
        with `splits`, a tuple of [B, T, c_s].
      new_state: [B, W-1, C] fp32, the last W-1 raw inputs before position lengths[b].
    """
    b, t, c = x.shape
    wdt = w.shape[1]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    xs = jnp.where(valid[..., None], x.astype(f32), 0.0)
    seq = jnp.concatenate([conv_state.astype(f32), xs], axis=1)  # [B, W-1+T, C]
    y = sum(seq[:, j : j + t] * w[:, j] for j in range(wdt))
    y = y * jax.nn.sigmoid(y)
    out = _l2_qk(y, qk_channels=qk_channels, head_dim=head_dim, l2_eps=l2_eps)
    out = jnp.where(valid[..., None], out, 0.0).astype(out_dtype)
    # The W-1 inputs before position lengths[b] sit at seq[lengths[b] : lengths[b] + W-1].
    pos = lengths[:, None] + jnp.arange(wdt - 1)[None, :]  # [B, W-1]
    new_state = jnp.take_along_axis(seq, pos[..., None], axis=1)
    return (out if splits is None else split_last(out, splits)), new_state


# --------------------------------------------------------------------------------------------
# Gate and beta
# --------------------------------------------------------------------------------------------
def gate_reference(
    f: jax.Array,
    b: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    head_dim: int,
    lower_bound: float | None,
) -> tuple[jax.Array, jax.Array]:
    """Per-channel log-decay and beta.

    Args:
      f: [..., P] forget-gate input f_b(f_a(x)), any float dtype.
      b: [..., H] beta logits.
      a_log: [H] fp32; dt_bias: [P] fp32.
      lower_bound: lb of the bounded gate, or None for the unbounded gate.
    Returns:
      g: [..., H, K] fp32, g < 0 (bounded: lb * sigmoid(exp(A_log) * (f + dt_bias));
         unbounded: -exp(A_log) * softplus(f + dt_bias), softplus linear above 20).
      beta: [..., H] fp32, sigmoid(b).
    """
    h = a_log.shape[-1]
    u = f.astype(f32) + dt_bias.astype(f32)
    u = u.reshape(*u.shape[:-1], h, head_dim)
    a = jnp.exp(a_log.astype(f32))[:, None]
    if lower_bound is None:
        sp = jnp.where(u > 20.0, u, jnp.log1p(jnp.exp(jnp.minimum(u, 20.0))))
        g = -a * sp
    else:
        g = lower_bound * jax.nn.sigmoid(a * u)
    return g, jax.nn.sigmoid(b.astype(f32))


# --------------------------------------------------------------------------------------------
# Recurrence (decode and verify)
# --------------------------------------------------------------------------------------------
def _recurrent_step(state, q, k, v, g, beta, scale):
    """One token for all (B, H): state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H]."""
    s = state * jnp.exp(g)[..., None]
    pred = jnp.einsum("bhkv,bhk->bhv", s, k, precision=lax.Precision.HIGHEST)
    delta = beta[..., None] * (v - pred)
    s = s + k[..., None] * delta[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", s, q * scale, precision=lax.Precision.HIGHEST)
    return s, o


def recurrent_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float,
    snapshots: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Walks R rows per sequence through the delta rule (SPEC §1, Recurrence).

    Args:
      q, k: [B, R, H, K] fp32, L2-normalised (q unscaled; `scale` is applied here).
      v: [B, R, H, V] fp32.
      g: [B, R, H, K] fp32 log-decay; beta: [B, R, H] fp32 (post-sigmoid).
      state: [B, H, K, V] fp32.
      snapshots: also return the state after every row.
    Returns:
      o: [B, R, H, V] fp32; new_state: [B, H, K, V] fp32;
      snaps: [B, R, H, K, V] fp32 or None.
    """
    xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, v, g, beta))

    def step(s, inp):
        s, o = _recurrent_step(s, *inp, scale)
        return s, (o, s if snapshots else None)

    new_state, (o, snaps) = lax.scan(step, state.astype(f32), xs)
    o = jnp.moveaxis(o, 0, 1)
    return o, new_state, (jnp.moveaxis(snaps, 0, 1) if snapshots else None)


# --------------------------------------------------------------------------------------------
# Sigmoid-gated RMSNorm
# --------------------------------------------------------------------------------------------
def o_norm_reference(
    o: jax.Array,
    z: jax.Array,
    w: jax.Array,
    *,
    eps: float,
    keep: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """y_h = o_h * rsqrt(mean(o_h^2) + eps) * w * sigmoid(z_h), per head, fp32 math, one cast.

    Args:
      o: [..., H, V] fp32 core output.
      z: [..., H*V] output-gate projection g_b(g_a(x)), any float dtype.
      w: [V] norm weight.
      keep: optional [...] fp32 per token: 1 keeps the norm, any other value replaces the
        token's output (0 at pads, NaN after a non-finite token).
    Returns:
      [..., H*V] out_dtype.
    """
    o = o.astype(f32)
    zh = z.astype(f32).reshape(o.shape)
    y = o * lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * w.astype(f32)
    y = y * jax.nn.sigmoid(zh)
    if keep is not None:
        keep = keep.astype(f32)[..., None, None]
        y = jnp.where(keep == 1.0, y, keep)
    return y.reshape(*o.shape[:-2], -1).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Chunked prefill core (SPEC §5): intra-chunk stage, state pass, output
# --------------------------------------------------------------------------------------------
def _decay_mask(c: int, strict: bool) -> jax.Array:
    """[C, C] bool: j <= i (j < i if strict)."""
    ii = jnp.arange(c)[:, None]
    jj = jnp.arange(c)[None, :]
    return jj < ii if strict else jj <= ii


def _decay(g: jax.Array, mask: jax.Array) -> jax.Array:
    """[..., C, C, K] exp(g_ik - g_jk) where mask, else 0: the mask applied before exp, so every
    exponent is <= 0 (g non-increasing along C)."""
    diff = g[..., :, None, :] - g[..., None, :, :]
    return jnp.exp(jnp.where(mask[..., None], diff, -jnp.inf))


_DECAY_BYTES = 1 << 28  # the most one group's [units, C, C, K] fp32 product may take


def _by_units(fn, *arrays):
    """fn over [U, C, ...] arrays (U = the leading dims, C, K from arrays[-1]), in groups of
    units whose [C, C, K] fp32 products take at most _DECAY_BYTES: XLA may materialise that
    product, and over every chunk of a long prefill it would be tens of GiB."""
    lead, (c, kd) = arrays[-1].shape[:-2], arrays[-1].shape[-2:]
    flat = [a.reshape(-1, *a.shape[len(lead) :]) for a in arrays]
    units = flat[0].shape[0]
    group = max(1, _DECAY_BYTES // (4 * c * c * kd))
    if units <= group:
        out = fn(*flat)
    else:
        n = -(-units // group)
        pad = lambda a: jnp.pad(a, [(0, n * group - units)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
        grouped = [pad(a).reshape(n, group, *a.shape[1:]) for a in flat]
        out = lax.map(lambda xs: fn(*xs), grouped)
        out = jax.tree.map(lambda o: o.reshape(n * group, *o.shape[2:])[:units], out)
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _decayed_scores(x: jax.Array, y: jax.Array, g: jax.Array, strict: bool) -> jax.Array:
    """S_ij = sum_k x_ik y_jk exp(g_ik - g_jk) for j <= i (j < i if strict), else 0.

    x, y, g: [..., C, K] -> S [..., C, C]. Each pass is one product reduced at once, and the VJP
    is two reductions of the same form (dx, dy; dg = x dx - y dy), so no pass keeps a
    [C, C, K] tensor for another; each runs by groups of chunks (`_by_units`).
    """
    mask = _decay_mask(x.shape[-2], strict)

    def scores(x, y, g):
        s = jnp.sum(x[..., :, None, :] * y[..., None, :, :] * _decay(g, mask), axis=-1)
        return jnp.where(mask, s, 0.0)

    return _by_units(scores, x, y, g)


def _decayed_scores_fwd(x, y, g, strict):
    return _decayed_scores(x, y, g, strict), (x, y, g)


def _decayed_scores_bwd(strict, res, ds):
    x, y, g = res
    mask = _decay_mask(x.shape[-2], strict)

    def grads(ds, x, y, g):
        ds = jnp.where(mask, ds, 0.0)[..., None]  # [..., C, C, 1]
        dx = jnp.sum(ds * y[..., None, :, :] * _decay(g, mask), axis=-2)
        dy = jnp.sum(ds * x[..., :, None, :] * _decay(g, mask), axis=-3)
        return dx, dy, x * dx - y * dy

    return _by_units(grads, ds, x, y, g)


_decayed_scores.defvjp(_decayed_scores_fwd, _decayed_scores_bwd)


SUB = 16  # rows of a sub-chunk of the decayed scores (`_chunk_scores`)


def _chunk_scores(x: jax.Array, y: jax.Array, g: jax.Array, strict: bool) -> jax.Array:
    """`_decayed_scores` of whole chunks, [..., C, K] -> [..., C, C], at a quarter of its
    elementwise work: within a sub-chunk of SUB rows the product is formed per element; across
    sub-chunks exp(g_i - g_j) factors through the first row r of row i's sub-chunk as
    exp(g_i - g_r) exp(g_r - g_j), both exponents <= 0 (j < r <= i, g non-increasing), so each
    sub-chunk's rows against the earlier columns are one matmul."""
    c, kd = x.shape[-2:]
    s = min(SUB, c)
    n = c // s
    sub = lambda a: a.reshape(*a.shape[:-2], n, s, kd)  # noqa: E731
    diag = _decayed_scores(sub(x), sub(y), sub(g), strict)  # [..., n, s, s]
    eye = jnp.eye(n, dtype=x.dtype)[:, None, :, None]  # [n, 1, n, 1]: exact, no dot
    out = (eye * diag[..., :, :, None, :]).reshape(*x.shape[:-2], c, c)
    if n == 1:
        return out
    g_ref = sub(g)[..., :1, :]  # [..., n, 1, K]
    before = (jnp.arange(c)[None, :] < s * jnp.arange(n)[:, None])[:, :, None]  # [n, C, 1]
    xr = sub(x) * jnp.exp(sub(g) - g_ref)  # [..., n, s, K]
    yr = y[..., None, :, :] * jnp.exp(jnp.where(before, g_ref - g[..., None, :, :], -jnp.inf))
    cross = jnp.einsum("...nik,...njk->...nij", xr, yr, precision=lax.Precision.HIGHEST)
    return out + cross.reshape(*x.shape[:-2], c, c)


def _unit_lower_inverse(m: jax.Array) -> jax.Array:
    """(m)^-1 of unit lower-triangular m [..., C, C] (C a power of two; diagonal and upper part
    ignored), by doubling: the inverses of the diagonal blocks of size s give those of size 2s,
    [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], every block of a level at once.
    Products only (no batched triangular solve, which cuBLAS runs slowly at C = 32), with the
    numerical behaviour of block substitution."""
    c = m.shape[-1]
    if c & (c - 1):
        raise ValueError(f"chunk width C = {c}: expected a power of two")
    hi = lax.Precision.HIGHEST
    lead = m.shape[:-2]
    inv = jnp.ones((*lead, c, 1, 1), m.dtype)  # the 1x1 diagonal blocks' inverses
    s = 1
    while s < c:
        n = c // (2 * s)  # blocks of size 2s
        blocks = m.reshape(*lead, c // s, s, c // s, s)
        lower = jnp.stack([blocks[..., 2 * j + 1, :, 2 * j, :] for j in range(n)], axis=-3)
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]  # [..., n, s, s]
        low = -jnp.einsum("...ij,...jk,...kl->...il", d_inv, lower, a_inv, precision=hi)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([low, d_inv], axis=-1)], axis=-2)
        s *= 2
    return inv[..., 0, :, :]


@jax.custom_vjp
def unit_lower_solve(m: jax.Array, rhs: jax.Array) -> jax.Array:
    """m^-1 rhs for unit lower-triangular m [..., C, C] (diagonal and upper part ignored, as
    `solve_triangular(..., lower=True, unit_diagonal=True)`), rhs [..., C, N]. The VJP reuses
    the forward's inverse: d rhs = m^-T dx, d m = -strict_lower(d rhs x^T)."""
    return _unit_lower_solve_fwd(m, rhs)[0]


def _unit_lower_solve_fwd(m, rhs):
    inv = _unit_lower_inverse(m)
    x = jnp.einsum("...ij,...jn->...in", inv, rhs, precision=lax.Precision.HIGHEST)
    return x, (inv, x)


def _unit_lower_solve_bwd(res, dx):
    inv, x = res
    hi = lax.Precision.HIGHEST
    drhs = jnp.einsum("...ji,...jn->...in", inv, dx, precision=hi)
    dm = -jnp.tril(jnp.einsum("...in,...jn->...ij", drhs, x, precision=hi), -1)
    return dm, drhs


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def _chunk_local(q, k, v, g, beta, scale):
    """Intra-chunk stage (SPEC §5 steps 1-3) of any number of chunks at once.

    q, k, g: [..., C, K]; v: [..., C, V]; beta: [..., C] (pads neutral: g = beta = k = 0).
    Returns (qg, kg, w, u, a, gl): qg = s q exp(G), kg = k exp(G_last - G), w = T(beta k exp(G)),
    u = T(beta v) with T = (I + beta strict-lower(k k^T decayed))^-1, a = s (q k^T decayed, j <= i)
    [..., C, C], gl = exp(G_last) [..., K]; G the inclusive chunk-local cumsum of g.
    """
    c = q.shape[-2]
    gc = jnp.cumsum(g, axis=-2)
    a = scale * _chunk_scores(q, k, gc, False)
    i_plus_l = jnp.eye(c, dtype=q.dtype) + beta[..., None] * _chunk_scores(k, k, gc, True)
    solve = functools.partial(unit_lower_solve, i_plus_l)
    qg, kg, w, u, gl = chunk_terms(q, k, v, gc, beta, scale, solve)
    return qg, kg, w, u, a, gl


def chunk_terms(q, k, v, gc, beta, scale, solve):
    """The intra-chunk stage's elementwise terms and its WY solve, given G = cumsum(g) (gc) and
    `solve(x)` = T x: (qg, kg, w, u, gl) as `_chunk_local` returns them."""
    kd = q.shape[-1]
    wu = solve(beta[..., None] * jnp.concatenate([k * jnp.exp(gc), v], axis=-1))
    g_last = gc[..., -1:, :]
    qg = scale * q * jnp.exp(gc)
    kg = k * jnp.exp(g_last - gc)
    return qg, kg, wu[..., :kd], wu[..., kd:], jnp.exp(g_last[..., 0, :])


def _state_step(h, kg, w, u, gl):
    """One chunk of the state pass (SPEC §5 step 4): h [..., K, V] -> (next h, delta [..., C, V])
    with delta = u - w h."""
    hi = lax.Precision.HIGHEST
    delta = u - jnp.einsum("...ck,...kv->...cv", w, h, precision=hi)
    h = gl[..., None] * h + jnp.einsum("...ck,...cv->...kv", kg, delta, precision=hi)
    return h, delta


def _chunk_output(qg, a, h, delta):
    """Output of every chunk at once (SPEC §5 step 5): qg h + a delta, [..., C, V]."""
    hi = lax.Precision.HIGHEST
    o = jnp.einsum("...ck,...kv->...cv", qg, h, precision=hi)
    return o + jnp.einsum("...ij,...jv->...iv", a, delta, precision=hi)


def chunk_kda_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Chunked delta-rule prefill (SPEC §5) over T tokens from a carried state.

    Pad positions must already be neutral (g = 0, beta = 0, k = 0; `kda_jax` zeroes them from
    `lengths`), so the state after T tokens equals the state after each row's real tokens. The
    intra-chunk stage runs over all chunks at once, rematerialised in the backward pass (it
    keeps its inputs, not its [C, C] and [C, K] intermediates); the state pass and output are
    `chunk_scan_reference`'s `lax.scan`.

    Args:
      q, k: [B, T, H, K] fp32, L2-normalised (q unscaled).
      v: [B, T, H, V] fp32.
      g: [B, T, H, K] fp32 per-token log-decay (<= 0).
      beta: [B, T, H] fp32.
      state: [B, H, K, V] fp32.
      chunk: C; T need not be a multiple of it.
    Returns:
      o: [B, T, H, V] fp32; new_state: [B, H, K, V] fp32 (float64 for float64 inputs, which
      the gradient checks use).
    """
    b, t, h = q.shape[:3]
    dtype = jnp.promote_types(q.dtype, f32)
    xs = tuple(_to_chunks(a.astype(dtype), chunk) for a in (q, k, v, g, beta))  # [B, H, N, C, .]
    *mats, gl = jax.checkpoint(_chunk_local, static_argnums=(5,))(*xs, scale)
    flat = lambda a: a.reshape(b, h, -1, a.shape[-1])  # noqa: E731 - [B, H, N*C, .]
    return chunk_scan_reference(*map(flat, mats), gl, state.astype(dtype), t=t)


# --------------------------------------------------------------------------------------------
# Composite stages: what the block's forward calls (a backend may fuse their parts)
# --------------------------------------------------------------------------------------------
def fused_recurrent_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    state: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    scale: float,
    lower_bound: float | None,
    l2_eps: float | None = None,
    snapshots: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gate, beta and the recurrence for R rows per sequence, no output norm (FLA's
    fused_recurrent_kda).

    Args:
      q, k: [B, R, H, K], L2-normalised, or raw with `l2_eps` (normalised here per head,
        1/sqrt(sum + l2_eps)); v: [B, R, H, V].
      f: [B, R, P] forget-gate input; b: [B, R, H] beta logits; state: [B, H, K, V] fp32.
    Returns:
      o: [B, R, H, V] fp32; new_state; snaps [B, R, H, K, V] or None.
    """
    if l2_eps is not None:
        q, k = q.astype(f32), k.astype(f32)
        q = q * lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + l2_eps)
        k = k * lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + l2_eps)
    g, beta = gate_reference(f, b, a_log, dt_bias, head_dim=q.shape[-1], lower_bound=lower_bound)
    return recurrent_reference(q, k, v, g, beta, state, scale=scale, snapshots=snapshots)


def decode_core_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    z: jax.Array,
    state: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    o_norm_w: jax.Array,
    *,
    scale: float,
    lower_bound: float | None,
    eps: float,
    snapshots: bool = False,
    out_dtype=jnp.bfloat16,
    slots: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gate, beta, recurrence and gated RMSNorm for R rows per sequence.

    Args:
      q, k, v: [B, R, H, K] fp32 from conv_decode (q, k L2-normalised).
      f: [B, R, P] forget-gate input; b: [B, R, H] beta logits; z: [B, R, P] output gate.
      state: [B, H, K, V] fp32; with slots [B] int32, a pool [N, H, K, V] read and written at
        slots[b] (a negative slot writes nothing; its y and snaps are `slot_fill`'s).
    Returns:
      y: [B, R, P] out_dtype (o_norm output); new_state (or the pool); snaps [B, R, H, K, V] or
      None.
    """
    if slots is not None:
        y, new_rows, snaps = decode_core_reference(
            q,
            k,
            v,
            f,
            b,
            z,
            pool_rows(state, slots),
            a_log,
            dt_bias,
            o_norm_w,
            scale=scale,
            lower_bound=lower_bound,
            eps=eps,
            snapshots=snapshots,
            out_dtype=out_dtype,
        )
        snaps = None if snaps is None else slot_fill(slots, snaps)
        return slot_fill(slots, y), pool_write(state, slots, new_rows), snaps
    g, beta = gate_reference(f, b, a_log, dt_bias, head_dim=q.shape[-1], lower_bound=lower_bound)
    o, new_state, snaps = recurrent_reference(
        q, k, v, g, beta, state, scale=scale, snapshots=snapshots
    )
    return o_norm_reference(o, z, o_norm_w, eps=eps, out_dtype=out_dtype), new_state, snaps


def prefill_core_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    g_a: jax.Array,
    g_b: jax.Array,
    state: jax.Array,
    lengths: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    o_norm_w: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    eps: float,
    g_bias: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    poison: jax.Array | None = None,
    slots: jax.Array | None = None,
    nan_state: jax.Array | None = None,
    precision=None,
    core=None,
) -> tuple[jax.Array, jax.Array]:
    """Gate, beta, chunked recurrence and gated RMSNorm over T padded tokens.

    Positions t >= lengths[b] get g = 0, beta = 0 and k = q = v = 0 (selected, so NaN there is
    harmless): they leave the state alone, and their output is 0, or NaN below `poison[b]`.

    Args:
      q, k, v: [B, T, H, K] from conv_prefill (q, k L2-normalised).
      f: [B, T, P]; b: [B, T, H]; state: [B, H, K, V] fp32; lengths: [B] int32.
      g_a: [B, T, R], g_b: [P, R], g_bias: optional [P]: the output gate, whose projection
        z = g_a g_b^T + g_bias is formed here in fp32 (the kernel path forms it in o_norm).
      poison: optional [B] int32 >= lengths: positions lengths[b] <= t < poison[b] output NaN
        (the real tokens from a row's first non-finite one on).
      slots: [B] int32 or None: state is then a pool [N, H, K, V] whose row slots[b] row b
        starts from and is written back to; a negative slot writes nothing (give it length 0).
      nan_state: optional [B] bool: rows whose final state is NaN (a non-finite real token;
        with slots, written at the row's slot); their gradients are zero.
      precision: of z's product (None: HIGHEST).
      core: the chunked core, with `chunk_kda_reference`'s signature (None: that function; the
        pallas backend's backward passes `chunk_vjp.chunk_kda_vjp`).
    Returns:
      y: [B, T, P] out_dtype; new_state: [B, H, K, V] fp32 (with slots, the pool).
    """
    if slots is not None:
        y, new_rows = prefill_core_reference(
            q,
            k,
            v,
            f,
            b,
            g_a,
            g_b,
            pool_rows(state, slots),
            lengths,
            a_log,
            dt_bias,
            o_norm_w,
            scale=scale,
            chunk=chunk,
            lower_bound=lower_bound,
            eps=eps,
            g_bias=g_bias,
            out_dtype=out_dtype,
            poison=poison,
            nan_state=nan_state,
            precision=precision,
            core=core,
        )
        return y, pool_write(state, slots, new_rows)
    t = q.shape[1]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    g, beta = gate_reference(f, b, a_log, dt_bias, head_dim=q.shape[-1], lower_bound=lower_bound)
    vm = valid[..., None, None]
    q, k, v, g = (jnp.where(vm, a.astype(f32), 0.0) for a in (q, k, v, g))
    beta = jnp.where(valid[..., None], beta, 0.0)
    o, new_state = (core or chunk_kda_reference)(q, k, v, g, beta, state, scale=scale, chunk=chunk)
    if nan_state is not None:
        new_state = jnp.where(nan_state[:, None, None, None], jnp.nan, new_state)
    keep = common.output_keep(lengths, t, poison)
    z = gemv_reference(
        g_a.reshape(-1, g_a.shape[-1]), g_b, out_dtype=f32, bias=g_bias, precision=precision
    ).reshape(*g_a.shape[:2], -1)
    return o_norm_reference(o, z, o_norm_w, eps=eps, keep=keep, out_dtype=out_dtype), new_state


def _packed_owners(seq_info: jax.Array, n_chunks: int, prefix_chunks: int, prefix_rows: int):
    """Per chunk of a packed stream: the sequence whose chunks hold it (Q for none) and the
    prefix row its final state goes to (prefix_rows for none); `seq_info` as in
    `prefill_core_packed_reference`."""
    q_ = seq_info.shape[0]
    lo, hi = seq_info[:, 0], seq_info[:, 1]
    c = jnp.arange(n_chunks)[:, None]
    inside = (lo[None, :] <= c) & (c < hi[None, :])  # [chunks, Q]
    owner = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), q_)
    if not prefix_chunks:
        return owner, None
    info = jnp.concatenate([seq_info, jnp.zeros((1, 4), seq_info.dtype)])[owner]
    done = jnp.arange(n_chunks) + 1 - info[:, 0]  # the sequence's chunks through this one
    row = done // prefix_chunks - 1
    ends = (owner < q_) & (done % prefix_chunks == 0) & (row < info[:, 3])
    return owner, jnp.where(ends, info[:, 2] + row, prefix_rows)


def prefill_core_packed_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    g_a: jax.Array,
    g_b: jax.Array,
    state: jax.Array,
    valid: jax.Array,
    seq_info: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    o_norm_w: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    eps: float,
    g_bias: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    slots: jax.Array | None = None,
    nan_state: jax.Array | None = None,
    prefix_block: int | None = None,
    prefix_rows: int = 0,
    precision=None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`prefill_core_reference` over one stream of S rows holding Q sequences, each on a range
    of whole chunks: each sequence starts from its own state and writes its final state back.

    Rows with valid = False are neutral (g = 0, beta = 0, q = k = v = 0, selected, so whatever
    they hold is harmless) and output 0. The state pass is one scan over the stream's chunks
    that keeps the Q states in its carry, each chunk reading and writing its sequence's row
    (differentiable: gradients stay within each sequence).

    Args:
      q, k, v: [S, H, K] (q, k L2-normalised); f: [S, P]; b: [S, H]; S a multiple of C.
      g_a: [S, R], g_b: [P, R], g_bias: optional [P]: the output gate, z = g_a g_b^T + g_bias
        formed here in fp32, as in `prefill_core_reference` (precision: of its product).
      state: [Q, H, K, V] fp32, or with slots [Q] int32 a pool read and written at slots[q]
        (a negative slot writes nothing).
      valid: [S] bool, the token rows.
      seq_info: [Q, 4] int32 per sequence: (first chunk, end chunk, first prefix row, prefix
        rows); the ranges [first, end) are disjoint, in stream order.
      nan_state: optional [Q] bool: sequences whose final state is NaN (a non-finite real
        token; with slots, at the sequence's slot), as in `prefill_core_reference`.
      prefix_block: with prefix_rows > 0, tokens between prefix states (a multiple of C): the
        state after every prefix_block tokens of sequence q goes to prefix rows first, +1, ...
        (as many as its info gives) of [prefix_rows, H, K, V]; other rows are 0.
    Returns:
      y: [S, P] out_dtype; new_state (with slots, the pool); prefix states or None.
    """
    s_len, h, kd = q.shape
    n_chunks = s_len // chunk
    prefix_chunks = prefix_block // chunk if prefix_rows else 0
    g, beta = gate_reference(f, b, a_log, dt_bias, head_dim=kd, lower_bound=lower_bound)
    vm = valid[:, None, None]
    q, k, v, g = (jnp.where(vm, a.astype(f32), 0.0) for a in (q, k, v, g))
    beta = jnp.where(valid[:, None], beta, 0.0)

    # [chunks, 1, H, C, ...]: one chunk of the stream per scan step, a batch of one.
    def to_chunks(a):
        return jnp.moveaxis(a.reshape(n_chunks, chunk, *a.shape[1:]), 1, 2)[:, None]

    xs = tuple(to_chunks(a) for a in (q, k, v, g, beta))
    owner, prow = _packed_owners(seq_info, n_chunks, prefix_chunks, prefix_rows)
    init = state if slots is None else pool_rows(state, slots)
    q_ = seq_info.shape[0]
    # Row Q of the carry (and row prefix_rows of the prefix states) takes the writes of chunks
    # that no sequence holds.
    rows = jnp.concatenate([init.astype(f32), jnp.zeros((1, *init.shape[1:]), f32)])
    pre = jnp.zeros((prefix_rows + 1, *init.shape[1:]), f32) if prefix_chunks else None
    qg, kg, w, u, a, gl = jax.checkpoint(_chunk_local, static_argnums=(5,))(*xs, scale)

    def step(carry, inp):
        rows, pre = carry
        x, who, at = inp
        st = lax.dynamic_index_in_dim(rows, who, keepdims=True)
        nxt, delta = _state_step(st, *x)
        rows = lax.dynamic_update_index_in_dim(rows, nxt[0], who, 0)
        if pre is not None:
            pre = lax.dynamic_update_index_in_dim(pre, nxt[0], at, 0)
        return (rows, pre), (st, delta)

    prow = owner if prow is None else prow
    (rows, pre), (hs, delta) = lax.scan(step, (rows, pre), ((kg, w, u, gl), owner, prow))
    o = _chunk_output(qg, a, hs, delta)
    o = jnp.moveaxis(o[:, 0], 1, 2).reshape(s_len, h, -1)  # [chunks, H, C, V] -> [S, H, V]
    z = gemv_reference(g_a, g_b, out_dtype=f32, bias=g_bias, precision=precision)
    y = o_norm_reference(o, z, o_norm_w, eps=eps, keep=valid.astype(f32), out_dtype=out_dtype)
    new = rows[:q_]
    if nan_state is not None:
        new = jnp.where(nan_state[:, None, None, None], jnp.nan, new)
    new_state = new if slots is None else pool_write(state, slots, new)
    return y, new_state, (None if pre is None else pre[:prefix_rows])


# --- chunk stages (chunk helper) ---
def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padded to N*C tokens."""
    b, t = x.shape[:2]
    n = -(-t // chunk)
    x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 3, 1)


def chunk_prepare_reference(
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
) -> tuple[jax.Array, ...]:
    """Intra-chunk stage of SPEC §5 (steps 1-3); the reference of `chunk_prepare.chunk_prepare`.

    Args:
      q, k: [B, T, H, K] L2-normalised (q unscaled); v: [B, T, H, V].
      f: [B, T, H*K] raw gate input; b: [B, T, H] beta logits; lengths: [B] int32.
      a_log: [H]; dt_bias: [H*K]; chunk: C; mm_dtype: dtype of the matrix outputs.
    Returns:
      (qg, kg, w, u, a, gl): qg = s q exp(G), kg = k exp(G_last - G), w = T(beta k exp(G)),
      u = T(beta v), all [B, H, N*C, K or V] mm_dtype but u fp32; a [B, H, N*C, C] mm_dtype,
      the q-k scores (j <= i, zeros above); gl [B, H, N, K] fp32, exp(G_last).
      Pads (t >= lengths[b]) are neutral: g = 0, beta = 0, q = k = v = 0.
    """
    t, kd = q.shape[1], q.shape[3]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    g, beta = gate_reference(f, b, a_log, dt_bias, head_dim=kd, lower_bound=lower_bound)
    vm = valid[..., None, None]
    q, k, v, g = (_to_chunks(jnp.where(vm, a.astype(f32), 0.0), chunk) for a in (q, k, v, g))
    beta = _to_chunks(jnp.where(valid[..., None], beta, 0.0), chunk)  # [B, H, N, C]
    qg, kg, w, u, a_mat, gl = _chunk_local(q, k, v, g, beta, scale)
    flat = lambda a, dt=mm_dtype: a.reshape(*a.shape[:2], -1, a.shape[-1]).astype(dt)  # noqa: E731
    return flat(qg), flat(kg), flat(w), flat(u, f32), flat(a_mat), gl


def chunk_scan_reference(
    qg: jax.Array,
    kg: jax.Array,
    w: jax.Array,
    u: jax.Array,
    a: jax.Array,
    gl: jax.Array,
    state: jax.Array,
    *,
    t: int,
) -> tuple[jax.Array, jax.Array]:
    """Inter-chunk state pass and output of SPEC §5 (steps 4-6); reference of `chunk_scan`.

    Args:
      qg, kg, w: [B, H, N*C, K]; u: [B, H, N*C, V]; a: [B, H, N*C, C]; gl: [B, H, N, K]
        (the outputs of `chunk_prepare_reference`); state: [B, H, K, V] fp32; t: T <= N*C.
    Returns:
      o: [B, T, H, V] fp32; new_state: [B, H, K, V] fp32 (float64 for float64 inputs).
    """
    bsz, h, tp, _ = qg.shape
    n, c = gl.shape[2], tp // gl.shape[2]
    dtype = jnp.promote_types(qg.dtype, f32)  # float64 in the gradient checks
    chunks = lambda x: jnp.moveaxis(  # noqa: E731
        x.astype(dtype).reshape(bsz, h, n, c, x.shape[-1]), 2, 0
    )
    qg, kg, w, u, a = (chunks(x) for x in (qg, kg, w, u, a))
    gl = jnp.moveaxis(gl.astype(dtype), 2, 0)

    def step(s, x):
        s_next, delta = _state_step(s, *x)
        return s_next, (s, delta)

    new_state, (hs, delta) = lax.scan(step, state.astype(dtype), (kg, w, u, gl))
    o = _chunk_output(qg, a, hs, delta)  # [N, B, H, C, V]
    o = jnp.moveaxis(o, 0, 2).reshape(bsz, h, tp, -1)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), new_state
