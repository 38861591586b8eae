"""Delta-rule recurrence for decode and the speculative verify (SPEC §1, Recurrence).

Per sequence b, head h and row r (rows walked in order inside the kernel):
```
S' = diag(exp(g_r)) S;  delta = beta_r (v_r - S'^T k_r);  S = S' + k_r delta^T;  o_r = S^T (s q_r)
```
Grid (B, H, V/block_v): a program owns the [K, block_v] slice of one head's state (the key axis
K is never split: `S'^T k` reduces over it). The state tile is read once, kept in registers for
all R rows and written once, in place when the caller donates it (`input_output_aliases`).

`decode_core` fuses what the decode step needs around the recurrence into the same kernel: the
gate and the beta sigmoid (`gate.gate_math`, the same expressions as the gate kernel) and, when
the V tile covers the whole head, the sigmoid-gated RMSNorm epilogue (`o_norm.gated_rms_norm`);
with a split V tile it calls the `o_norm` kernel after. Every row runs the same code (`_step`),
and the tiling never depends on R, so row r of an R-row call has the bits of the r-th of R serial
1-row calls (what `decode_k` promises).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.gate import beta_math, gate_math
from pallas_kernels.o_norm import gated_rms_norm, o_norm

__all__ = ["RecurrentBlockSizes", "recurrent", "decode_core"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RecurrentBlockSizes:
    """Tiling of the recurrent kernel.

    Attributes:
      block_v: V columns of the state per program (power of two dividing V). block_v == V lets
        `decode_core` fuse the RMSNorm epilogue.
      num_warps: Triton warps per program.
    """

    block_v: int
    num_warps: int

    @staticmethod
    def default_for(batch: int, heads: int, k: int, v: int) -> RecurrentBlockSizes:
        """V tiles of 32 columns: 4x the programs of whole heads (B=1, H=32 is 128 programs),
        which measured faster on the H200 at B = 1 and 64 than whole heads even with RMSNorm as
        a second launch; 64 columns once B*H >= 1024 sequence-heads fill the GPU anyway. H200,
        2026-12-01, decode core at B=64, H=32, device time (CUPTI) in one job: V tile 64 with 4
        warps 80.8 us, 32 with 4 warps 87.4 (2 warps 90.4, 8 warps 95.3), 64 with 8 warps (the
        old default) 101.9, 16 with 2 warps 134.5; FLA's fused_recurrent_kda 88.4-89.1 beside
        them. Never depends on R (bit-equality)."""
        return RecurrentBlockSizes.with_block_v(k, min(v, 64 if batch * heads >= 1024 else 32))

    @staticmethod
    def with_block_v(k: int, block_v: int) -> RecurrentBlockSizes:
        """A V tile of block_v columns: 32 state values per thread up to 4 warps, then 4 warps
        up to 64 values per thread (the [128, 64] tile: 4 warps measured 80.8 us against 101.9
        for 8 at B=64, see `default_for`), and up to 8 warps beyond."""
        values = k * block_v
        warps = values // 1024 if values <= 4 * 1024 else max(4, values // 2048)
        return RecurrentBlockSizes(block_v=block_v, num_warps=max(1, min(8, warps)))


class _Fusions(NamedTuple):
    """Static description of what the kernel computes besides the recurrence."""

    gate: bool  # f, b logits, A_log, dt_bias in; g and beta computed in the kernel
    lower_bound: float | None
    norm_eps: float | None  # fused RMSNorm epilogue (needs block_v == V)
    l2_eps: float | None  # L2-normalise q and k in the kernel (raw q/k inputs)
    snapshots: bool


def _step(s, q, k, v, g, beta, scale):
    """One row on a state tile. s: [K, BV]; q, k, g: [K]; v: [BV]; beta: [1]. fp32."""
    s = s * jnp.exp(g)[:, None]
    pred = jnp.sum(s * k[:, None], axis=0)
    delta = beta * (v - pred)
    s = s + k[:, None] * delta[None, :]
    o = jnp.sum(s * (q * scale)[:, None], axis=0)
    return s, o


def _l2(x, eps):
    return x * jax.lax.rsqrt(jnp.sum(x * x) + eps)


def _recurrent_kernel(*refs, rows: int, scale: float, fu: _Fusions):
    """Refs, in order (R rows of one sequence b, head h, V tile j):
    q_ref, k_ref: [R, K]; v_ref: [R, BV];
    gate fused: f_ref [R, K], b_ref [R], a_log_ref [1], dt_ref [K];
      else g_ref [R, K], beta_ref [R];
    state_ref: [K, BV];
    norm fused: z_ref [R, V], w_ref [V];
    outputs: out_ref [R, BV] (o fp32, or y out_dtype when the norm is fused);
    new_state_ref [K, BV]; snaps_ref [R, K, BV] when snapshots.
    """
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    q_ref, k_ref, v_ref = take(3)
    gate_refs = take(4 if fu.gate else 2)
    (state_ref,) = take(1)
    norm_refs = take(2) if fu.norm_eps is not None else None
    out_ref, new_state_ref = take(2)
    snaps_ref = take(1)[0] if fu.snapshots else None

    if fu.gate:
        f_ref, b_ref, a_log_ref, dt_ref = gate_refs
        a = jnp.exp(a_log_ref[...].astype(f32))  # [1]
        dt = dt_ref[...].astype(f32)
    else:
        g_ref, beta_ref = gate_refs

    # Every row's inputs are loaded before the first row's stores: a load after a store waits
    # for it (the compiler cannot tell the refs apart), which made R rows R memory round trips
    # (H200, 2026-12-01, B = 1: 11.3 us at R = 8 against 2.9 at R = 1 before this order, 8.7
    # after it, in two jobs; benchmarks/NOTES.md, sessions 6 and 8).
    if fu.gate:
        gates = [(f_ref[r], b_ref[pl.ds(r, 1)]) for r in range(rows)]
    else:
        gates = [(g_ref[r], beta_ref[pl.ds(r, 1)]) for r in range(rows)]
    loaded = [(q_ref[r], k_ref[r], v_ref[r], *gates[r]) for r in range(rows)]
    if norm_refs is not None:
        z_ref, w_ref = norm_refs
        zs = [z_ref[r] for r in range(rows)]
        w_norm = w_ref[...].astype(f32)
    s = state_ref[...].astype(f32)
    for r, (q, k, v, g_in, b_in) in enumerate(loaded):
        q, k = q.astype(f32), k.astype(f32)
        if fu.l2_eps is not None:
            q, k = _l2(q, fu.l2_eps), _l2(k, fu.l2_eps)
        if fu.gate:
            g = gate_math(g_in.astype(f32) + dt, a, fu.lower_bound)
            beta = beta_math(b_in)
        else:
            g = g_in.astype(f32)
            beta = b_in.astype(f32)
        s, o = _step(s, q, k, v.astype(f32), g, beta, scale)
        if common.interpret():
            # XLA on a CPU recomputes s inside every consumer's fusion (the snapshot, the next
            # row, the final store), with different FMA contraction per copy; pin one value so
            # interpret mode keeps the bit-equality that the compiled kernel (one register value
            # per row) is built for.
            s, o = jax.lax.optimization_barrier((s, o))
        if norm_refs is not None:
            o = gated_rms_norm(o, zs[r].astype(f32), w_norm, fu.norm_eps)
        out_ref[r] = o.astype(out_ref.dtype)
        if snaps_ref is not None:
            snaps_ref[r] = s
    new_state_ref[...] = s


def _call(q, k, v, gate_args, state, norm_args, *, scale, fu: _Fusions, out_dtype, block):
    """Builds and runs the pallas_call. q, k: [B, R, H, K]; v: [B, R, H, V]; gate_args: (f
    [B, R, H, K], b [B, R, H], a_log [H], dt [H, K]) or (g [B, R, H, K], beta [B, R, H]);
    norm_args: (z [B, R, H, V], w [V]) or None. Returns (out [B, R, H, V], state, snaps|None)."""
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    bv = block.block_v
    if vd % bv or bv & (bv - 1):
        raise ValueError(f"block_v={bv} must be a power of two dividing V={vd}")
    if fu.norm_eps is not None and bv != vd:
        raise ValueError(f"the fused RMSNorm needs block_v == V, got block_v={bv}, V={vd}")
    rows_k = pl.BlockSpec((None, r, None, kd), lambda i, j, n: (i, 0, j, 0))
    rows_v = pl.BlockSpec((None, r, None, bv), lambda i, j, n: (i, 0, j, n))
    rows_1 = pl.BlockSpec((None, r, None), lambda i, j, n: (i, 0, j))
    state_spec = pl.BlockSpec((None, None, kd, bv), lambda i, j, n: (i, j, 0, n))
    if fu.gate:
        gate_specs = [
            rows_k,
            rows_1,
            pl.BlockSpec((1,), lambda i, j, n: (j,)),
            pl.BlockSpec((None, kd), lambda i, j, n: (j, 0)),
        ]
    else:
        gate_specs = [rows_k, rows_1]
    in_specs = [rows_k, rows_k, rows_v, *gate_specs, state_spec]
    inputs = [q, k, v, *gate_args, state]
    state_index = len(inputs) - 1
    if norm_args is not None:
        in_specs += [rows_v, pl.BlockSpec((vd,), lambda i, j, n: (0,))]
        inputs += list(norm_args)
    out_shape = [
        jax.ShapeDtypeStruct((bsz, r, h, vd), out_dtype),
        jax.ShapeDtypeStruct((bsz, h, kd, vd), f32),
    ]
    out_specs = [rows_v, state_spec]
    if fu.snapshots:
        out_shape.append(jax.ShapeDtypeStruct((bsz, r, h, kd, vd), f32))
        out_specs.append(pl.BlockSpec((None, r, None, kd, bv), lambda i, j, n: (i, 0, j, 0, n)))
    outs = pl.pallas_call(
        functools.partial(_recurrent_kernel, rows=r, scale=scale, fu=fu),
        out_shape=tuple(out_shape),
        grid=(bsz, h, vd // bv),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        input_output_aliases={state_index: 1},
        compiler_params=plt.CompilerParams(num_warps=block.num_warps, num_stages=1),
        name="kda_recurrent",
        interpret=common.interpret(),
    )(*inputs)
    return outs[0], outs[1], (outs[2] if fu.snapshots else None)


def _check_rows(q, k, v, state, what):
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{what}: q {q.shape}, k {k.shape}, v {v.shape}: expected q, k "
            "[B, R, H, K] and v [B, R, H, V]"
        )
    if tuple(state.shape) != (bsz, h, kd, vd):
        raise ValueError(f"{what}: state has shape {state.shape}, expected {(bsz, h, kd, vd)}")
    if kd & (kd - 1) or vd & (vd - 1) or kd < 16:
        raise ValueError(f"{what}: K={kd}, V={vd} must be powers of two, K >= 16")


def recurrent(
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
    """Walks R rows per sequence through the delta rule; the kernel of
    `reference.recurrent_reference`.

    Args:
      q, k: [B, R, H, K] L2-normalised (q unscaled; `scale` is applied here), any float dtype.
      v: [B, R, H, V].
      g: [B, R, H, K] fp32 log-decay; beta: [B, R, H] fp32 (post-sigmoid).
      state: [B, H, K, V] fp32; updated in place when the caller donates it.
      scale: s = K^-0.5.
      snapshots: also return the state after every row.
    Returns:
      o: [B, R, H, V] fp32; new_state: [B, H, K, V] fp32; snaps: [B, R, H, K, V] fp32 or None.
    """
    _check_rows(q, k, v, state, "recurrent")
    if g.shape != q.shape or beta.shape != q.shape[:3]:
        raise ValueError(
            f"recurrent: g {g.shape}, beta {beta.shape}: expected {q.shape} and {q.shape[:3]}"
        )
    bsz, _, h, kd = q.shape
    block = RecurrentBlockSizes.default_for(bsz, h, kd, v.shape[-1])
    fu = _Fusions(gate=False, lower_bound=None, norm_eps=None, l2_eps=None, snapshots=snapshots)
    return _call(
        q, k, v, (g, beta), state.astype(f32), None, scale=scale, fu=fu, out_dtype=f32, block=block
    )


def _decode_core(
    q,
    k,
    v,
    f,
    b,
    z,
    state,
    a_log,
    dt_bias,
    o_norm_w,
    *,
    scale,
    lower_bound,
    eps,
    snapshots,
    out_dtype,
    l2_eps=None,
    block=None,
    norm=True,
):
    """decode_core with three knobs the public wrapper fixes, for comparisons with kernels that
    do less or more: `l2_eps` (q, k arrive raw and are L2-normalised in the kernel), `block`,
    and `norm` (False: no RMSNorm, fused or launched; y is the read-out o [B, R, P] in fp32,
    as `recurrent` returns it, and z, o_norm_w, eps and out_dtype are unused)."""
    _check_rows(q, k, v, state, "decode_core")
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    p = h * kd
    if f.shape != (bsz, r, p) or b.shape != (bsz, r, h) or z.shape != (bsz, r, h * vd):
        raise ValueError(
            f"decode_core: f {f.shape}, b {b.shape}, z {z.shape}: expected "
            f"{(bsz, r, p)}, {(bsz, r, h)}, {(bsz, r, h * vd)}"
        )
    if a_log.shape != (h,) or dt_bias.shape != (p,) or o_norm_w.shape != (vd,):
        raise ValueError(
            f"decode_core: a_log {a_log.shape}, dt_bias {dt_bias.shape}, o_norm_w "
            f"{o_norm_w.shape}: expected ({h},), ({p},), ({vd},)"
        )
    block = block or RecurrentBlockSizes.default_for(bsz, h, kd, vd)
    fused_norm = norm and block.block_v == vd
    fu = _Fusions(
        gate=True,
        lower_bound=lower_bound,
        norm_eps=eps if fused_norm else None,
        l2_eps=l2_eps,
        snapshots=snapshots,
    )
    gate_args = (f.reshape(bsz, r, h, kd), b, a_log, dt_bias.reshape(h, kd))
    norm_args = (z.reshape(bsz, r, h, vd), o_norm_w) if fused_norm else None
    out, new_state, snaps = _call(
        q,
        k,
        v,
        gate_args,
        state.astype(f32),
        norm_args,
        scale=scale,
        fu=fu,
        out_dtype=out_dtype if fused_norm else f32,
        block=block,
    )
    if norm and not fused_norm:
        y = o_norm(out, z, o_norm_w, eps=eps, out_dtype=out_dtype)
    else:  # normed in the kernel, or not at all
        y = out.reshape(bsz, r, h * vd)
    return y, new_state, snaps


def decode_core(
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
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gate, beta, recurrence and gated RMSNorm for R rows per sequence, fused; the kernel of
    `reference.decode_core_reference`.

    Args:
      q, k, v: [B, R, H, K] fp32 from conv_decode (q, k L2-normalised; q unscaled).
      f: [B, R, P] forget-gate input; b: [B, R, H] beta logits; z: [B, R, P] output gate.
      state: [B, H, K, V] fp32; updated in place when the caller donates it.
      a_log: [H] fp32; dt_bias: [P] fp32; o_norm_w: [V].
      scale: s = K^-0.5; lower_bound: the bounded gate's lb, or None (unbounded);
      eps: the RMSNorm epsilon; snapshots: also return the state after every row.
      out_dtype: dtype of y.
    Returns:
      y: [B, R, P] out_dtype; new_state: [B, H, K, V] fp32; snaps: [B, R, H, K, V] fp32 or None.
    """
    return _decode_core(
        q,
        k,
        v,
        f,
        b,
        z,
        state,
        a_log,
        dt_bias,
        o_norm_w,
        scale=scale,
        lower_bound=lower_bound,
        eps=eps,
        snapshots=snapshots,
        out_dtype=out_dtype,
    )
