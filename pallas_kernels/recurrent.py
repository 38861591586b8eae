"""Delta-rule recurrence for decode and the speculative verify (SPEC §1, Recurrence).

Per sequence b, head h and row r (rows walked in order inside the kernel):
```
g_r = gate(f_r);  beta_r = sigmoid(b_r)
S' = diag(exp(g_r)) S;  delta = beta_r (v_r - S'^T k_r);  S = S' + k_r delta^T;  o_r = S^T (s q_r)
```
Grid (B, H, V/block_v): a program owns the [K, block_v] slice of one head's state (the key axis
K is never split: `S'^T k` reduces over it). The state tile is read once, kept in registers for
all R rows and written once, in place when the caller donates it (`input_output_aliases`). The
gate and the beta sigmoid are formed in the kernel from the raw f and b (`gate.gate_math`).

Two ops run the kernel:
- `decode_core`, the block's decode stage, adds the sigmoid-gated RMSNorm epilogue
  (`o_norm.gated_rms_norm`) in the kernel when the V tile covers the whole head, and calls the
  `o_norm` kernel after it otherwise;
- `fused_recurrent` stops at the read-out o and can L2-normalise raw q and k in the kernel: FLA's
  `fused_recurrent_kda`, the work the decode core is benchmarked against.
Every row runs the same code (`_step`), and the tiling never depends on R, so row r of an R-row
call has the bits of the r-th of R serial 1-row calls (what `decode_k` promises).

With `slots` (decode_core) the state is a pool [N, H, K, V] handed to the kernel whole: a
program loads its tile from pool[slot] and stores it back there (the pool aliased in and out),
so serving B of N sequences moves B states and no gathered copy; the arithmetic, and so the
bits, are the dense call's.
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

__all__ = ["RecurrentBlockSizes", "decode_core", "fused_recurrent"]

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
    def get_default(batch: int, heads: int, k: int, v: int) -> RecurrentBlockSizes:
        """V tiles of 32 columns: 4x the programs of whole heads (B=1, H=32 is 128 programs),
        faster on the H200 at B = 1 and 64 than whole heads even with the RMSNorm as a second
        launch; 64 columns once B*H >= 1024 sequence-heads fill the GPU anyway. Never depends
        on R (bit-equality)."""
        return RecurrentBlockSizes.with_block_v(k, min(v, 64 if batch * heads >= 1024 else 32))

    @staticmethod
    def with_block_v(k: int, block_v: int) -> RecurrentBlockSizes:
        """A V tile of block_v columns: 32 state values per thread up to 4 warps, then 4 warps
        up to 64 values per thread (the [128, 64] tile: faster than 8 warps), and up to 8 warps
        beyond."""
        values = k * block_v
        warps = values // 1024 if values <= 4 * 1024 else max(4, values // 2048)
        return RecurrentBlockSizes(block_v=block_v, num_warps=max(1, min(8, warps)))


class _Fusions(NamedTuple):
    """Static description of what the kernel computes besides the gate and the recurrence."""

    lower_bound: float | None
    norm_eps: float | None  # fused RMSNorm epilogue (needs block_v == V)
    l2_eps: float | None  # L2-normalise q and k in the kernel (raw q/k inputs)
    snapshots: bool
    pooled: bool = False  # the state is a pool read and written at each row's slot


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


def _recurrent_kernel(*refs, rows: int, scale: float, fu: _Fusions, interpret: bool):
    """R rows of one sequence b, head h, V tile j. Refs, in order:
    q_ref, k_ref: [R, K]; v_ref: [R, BV]; f_ref: [R, K]; b_ref: [R]; a_log_ref: [1];
    dt_ref: [K]; state_ref: [K, BV] (pooled: the whole pool [N, H, K, V]); with the fused
    norm z_ref [R, V] and w_ref [V]; pooled, slot_ref [1];
    outputs: out_ref [R, BV] (o fp32, or y out_dtype with the fused norm);
    new_state_ref [K, BV] (pooled: the pool, aliased); snaps_ref [R, K, BV] with snapshots.
    Pooled, the program reads and writes pool[slot, h, :, tile j]; a negative slot reads slot 0
    (in bounds), writes nothing and stores 0 (slot -1, padding) or NaN (below -1) as its out and
    snapshots.
    """
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    q_ref, k_ref, v_ref, f_ref, b_ref, a_log_ref, dt_ref, state_ref = take(8)
    norm_refs = take(2) if fu.norm_eps is not None else None
    slot = take(1)[0][0] if fu.pooled else None
    out_ref, new_state_ref = take(2)
    snaps_ref = take(1)[0] if fu.snapshots else None
    keep = lambda a: a  # noqa: E731
    tile = (Ellipsis,)
    if fu.pooled:
        bv = out_ref.shape[-1]  # read here: interpret mode cannot see program_id in pl.when
        tile = (
            jnp.maximum(slot, 0),
            pl.program_id(1),
            slice(None),
            pl.ds(pl.program_id(2) * bv, bv),
        )
        fill = jnp.where(slot == -1, f32(0), f32(jnp.nan))  # typed: Triton lowering
        keep = lambda a: jnp.where(slot >= 0, a, fill)  # noqa: E731

    a = jnp.exp(a_log_ref[...].astype(f32))  # [1]
    dt = dt_ref[...].astype(f32)
    # Every row's inputs are loaded before the first row's stores: a load after a store waits
    # for it (the compiler cannot tell the refs apart), which would make R rows R memory round
    # trips.
    gates = [(f_ref[r], b_ref[pl.ds(r, 1)]) for r in range(rows)]
    loaded = [(q_ref[r], k_ref[r], v_ref[r], *gates[r]) for r in range(rows)]
    if norm_refs is not None:
        z_ref, w_ref = norm_refs
        zs = [z_ref[r] for r in range(rows)]
        w_norm = w_ref[...].astype(f32)
    s = state_ref[tile].astype(f32)
    for r, (q, k, v, f, b) in enumerate(loaded):
        q, k = q.astype(f32), k.astype(f32)
        if fu.l2_eps is not None:
            q, k = _l2(q, fu.l2_eps), _l2(k, fu.l2_eps)
        g = gate_math(f.astype(f32) + dt, a, fu.lower_bound)
        beta = beta_math(b)
        s, o = _step(s, q, k, v.astype(f32), g, beta, scale)
        if interpret:
            # XLA on a CPU recomputes s inside every consumer's fusion (the snapshot, the next
            # row, the final store), with different FMA contraction per copy; pin one value so
            # interpret mode keeps the bit-equality that the compiled kernel (one register value
            # per row) is built for.
            s, o = jax.lax.optimization_barrier((s, o))
        if norm_refs is not None:
            o = gated_rms_norm(o, zs[r].astype(f32), w_norm, fu.norm_eps)
        out_ref[r] = keep(o).astype(out_ref.dtype)
        if snaps_ref is not None:
            snaps_ref[r] = keep(s)
    if fu.pooled:

        @pl.when(slot >= 0)
        def _():
            new_state_ref[tile] = s

    else:
        new_state_ref[...] = s


def _call(
    q, k, v, f, b, state, a_log, dt_bias, norm_args, slots, *, scale, fu, out_dtype, blk, interpret
):
    """Builds and runs the pallas_call. q, k: [B, R, H, K]; v: [B, R, H, V]; f: [B, R, P];
    b: [B, R, H]; a_log: [H]; dt_bias: [P]; norm_args: (z [B, R, P], w [V]) or None;
    state [B, H, K, V], or with slots [B] int32 a pool [N, H, K, V].
    Returns (out [B, R, H, V], state or pool, snaps | None)."""
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    bv = blk.block_v
    if vd % bv or bv & (bv - 1):
        raise ValueError(
            f"RecurrentBlockSizes.block_v={bv}: expected a power of two dividing V={vd}"
        )
    if fu.norm_eps is not None and bv != vd:
        raise ValueError(f"the fused RMSNorm needs block_v == V, got block_v={bv}, V={vd}")
    rows_k = pl.BlockSpec((None, r, None, kd), lambda i, j, n: (i, 0, j, 0))
    rows_v = pl.BlockSpec((None, r, None, bv), lambda i, j, n: (i, 0, j, n))
    rows_1 = pl.BlockSpec((None, r, None), lambda i, j, n: (i, 0, j))
    state_spec = pl.BlockSpec((None, None, kd, bv), lambda i, j, n: (i, j, 0, n))
    if slots is not None:  # the whole pool, reached at each row's slot in the kernel
        state_spec = pl.no_block_spec
    gate_specs = [
        rows_k,
        rows_1,
        pl.BlockSpec((1,), lambda i, j, n: (j,)),
        pl.BlockSpec((None, kd), lambda i, j, n: (j, 0)),
    ]
    in_specs = [rows_k, rows_k, rows_v, *gate_specs, state_spec]
    gate_args = (f.reshape(bsz, r, h, kd), b, a_log, dt_bias.reshape(h, kd))
    inputs = [q, k, v, *gate_args, state.astype(f32)]
    state_index = len(inputs) - 1
    if norm_args is not None:
        z, w = norm_args
        in_specs += [rows_v, pl.BlockSpec((vd,), lambda i, j, n: (0,))]
        inputs += [z.reshape(bsz, r, h, vd), w]
    if slots is not None:
        in_specs.append(pl.BlockSpec((1,), lambda i, j, n: (i,)))
        inputs.append(slots.astype(jnp.int32))
    out_shape = [
        jax.ShapeDtypeStruct((bsz, r, h, vd), out_dtype),
        jax.ShapeDtypeStruct(state.shape, f32),
    ]
    out_specs = [rows_v, state_spec]
    if fu.snapshots:
        out_shape.append(jax.ShapeDtypeStruct((bsz, r, h, kd, vd), f32))
        out_specs.append(pl.BlockSpec((None, r, None, kd, bv), lambda i, j, n: (i, 0, j, 0, n)))
    outs = pl.pallas_call(
        functools.partial(_recurrent_kernel, rows=r, scale=scale, fu=fu, interpret=interpret),
        out_shape=tuple(out_shape),
        grid=(bsz, h, vd // bv),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        input_output_aliases={state_index: 1},
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=1),
        name="kda_recurrent",
        interpret=interpret,
    )(*inputs)
    return outs[0], outs[1], (outs[2] if fu.snapshots else None)


def _check(q, k, v, f, b, state, a_log, dt_bias, what, slots=None):
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    p = h * kd
    if slots is not None:
        if tuple(slots.shape) != (bsz,) or not jnp.issubdtype(slots.dtype, jnp.integer):
            raise ValueError(
                f"{what}: slots has shape {tuple(slots.shape)} and dtype {slots.dtype}, "
                f"expected [{bsz}] integers"
            )
        if state.ndim != 4 or state.shape[0] < 1:
            raise ValueError(
                f"{what}: the pool has shape {state.shape}, expected [N >= 1, H, K, V]"
            )
    n = bsz if slots is None else state.shape[0]  # the pool's rows
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{what}: q {q.shape}, k {k.shape}, v {v.shape}: expected q, k "
            "[B, R, H, K] and v [B, R, H, V]"
        )
    if tuple(state.shape) != (n, h, kd, vd):
        raise ValueError(f"{what}: state has shape {state.shape}, expected {(n, h, kd, vd)}")
    if kd & (kd - 1) or vd & (vd - 1) or kd < 16:
        raise ValueError(f"{what}: K={kd}, V={vd} must be powers of two, K >= 16")
    if f.shape != (bsz, r, p) or b.shape != (bsz, r, h):
        raise ValueError(f"{what}: f {f.shape}, b {b.shape}: expected {(bsz, r, p)}, {(bsz, r, h)}")
    if a_log.shape != (h,) or dt_bias.shape != (p,):
        raise ValueError(
            f"{what}: a_log {a_log.shape}, dt_bias {dt_bias.shape}: expected ({h},), ({p},)"
        )


def fused_recurrent(
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
    block_sizes: RecurrentBlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gate, beta and the delta rule for R rows per sequence, no output norm (FLA's
    `fused_recurrent_kda`); the kernel of `reference.fused_recurrent_reference`.

    Args:
      q, k: [B, R, H, K] L2-normalised, or raw with `l2_eps` (q unscaled); v: [B, R, H, V];
        any float dtype.
      f: [B, R, P] forget-gate input; b: [B, R, H] beta logits.
      state: [B, H, K, V] fp32; updated in place when the caller donates it.
      a_log: [H] fp32; dt_bias: [P] fp32.
      scale: s = K^-0.5; lower_bound: the bounded gate's lb, or None (unbounded).
      l2_eps: when set, q and k are L2-normalised in the kernel, 1/sqrt(sum + l2_eps) per head
        (FLA's use_qk_l2norm_in_kernel).
      snapshots: also return the state after every row.
      block_sizes: tiling (default `RecurrentBlockSizes.get_default(B, H, K, V)`).
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      o: [B, R, H, V] fp32; new_state: [B, H, K, V] fp32; snaps: [B, R, H, K, V] fp32 or None.
    """
    _check(q, k, v, f, b, state, a_log, dt_bias, "fused_recurrent")
    bsz, _, h, kd = q.shape
    blk = block_sizes or RecurrentBlockSizes.get_default(bsz, h, kd, v.shape[-1])
    fu = _Fusions(lower_bound=lower_bound, norm_eps=None, l2_eps=l2_eps, snapshots=snapshots)
    return _call(
        q,
        k,
        v,
        f,
        b,
        state,
        a_log,
        dt_bias,
        None,
        None,
        scale=scale,
        fu=fu,
        out_dtype=f32,
        blk=blk,
        interpret=common.resolve_interpret(interpret),
    )


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
    slots: jax.Array | None = None,
    block_sizes: RecurrentBlockSizes | None = None,
    interpret: bool | None = None,
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
      slots: [B] int32 or None. When given, state is a pool [N, H, K, V] and row b reads and
        writes pool[slots[b]] in the kernel, in place when the caller donates the pool (no
        gathered copy); a negative slot reads and writes nothing, and that row's y and snaps
        are 0 (slot -1, padding) or NaN (below -1). Non-negative slots must be distinct and
        below N (two programs would race on one state).
      block_sizes: tiling (default `RecurrentBlockSizes.get_default(B, H, K, V)`); with
        block_v == V the RMSNorm runs in the kernel, else in the `o_norm` kernel after it.
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      y: [B, R, P] out_dtype; new_state: [B, H, K, V] fp32 (with slots the pool [N, H, K, V],
      only the named slots changed); snaps: [B, R, H, K, V] fp32 or None.
    """
    _check(q, k, v, f, b, state, a_log, dt_bias, "decode_core", slots)
    bsz, r, h, kd = q.shape
    vd = v.shape[-1]
    if z.shape != (bsz, r, h * vd) or o_norm_w.shape != (vd,):
        raise ValueError(
            f"decode_core: z {z.shape}, o_norm_w {o_norm_w.shape}: expected "
            f"{(bsz, r, h * vd)}, ({vd},)"
        )
    interpret = common.resolve_interpret(interpret)
    blk = block_sizes or RecurrentBlockSizes.get_default(bsz, h, kd, vd)
    fused_norm = blk.block_v == vd
    fu = _Fusions(
        lower_bound=lower_bound,
        norm_eps=eps if fused_norm else None,
        l2_eps=None,
        snapshots=snapshots,
        pooled=slots is not None,
    )
    out, new_state, snaps = _call(
        q,
        k,
        v,
        f,
        b,
        state,
        a_log,
        dt_bias,
        (z, o_norm_w) if fused_norm else None,
        slots,
        scale=scale,
        fu=fu,
        out_dtype=out_dtype if fused_norm else f32,
        blk=blk,
        interpret=interpret,
    )
    if fused_norm:
        return out.reshape(bsz, r, h * vd), new_state, snaps
    # The rows of negative slots get the kernel's fill after the norm too (z may hold anything).
    y = o_norm(out, z, o_norm_w, eps=eps, slots=slots, out_dtype=out_dtype, interpret=interpret)
    return y, new_state, snaps
