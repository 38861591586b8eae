"""Inter-chunk stage of the chunked prefill (SPEC §5, steps 4-6): the state pass and the output.

One program per (sequence, head, V tile) walks the chunks in order with the state tile in
registers (fp32, held transposed as S^T [BV, K] so the per-key decay is a row broadcast):

    Delta  = u - w S                           [C, BV]  (the per-token delta-rule errors)
    O      = qg S + A Delta                    [C, BV]  (qg = s q exp(G) from chunk_prepare)
    S_next = diag(gl) S + kg^T Delta           [K, BV]  (gl = exp(G_last), kg = k exp(G_last - G))

The matrix products take their operands in the intermediates' dtype with fp32 accumulation. With
bf16 intermediates the state is rounded to bf16 for the products with w and qg only (as FLA
does), while Delta enters its products with A and kg as a bf16 hi + lo pair, and u arrives in
fp32: on weakly decaying heads at long T these two cut the output error by about a fifth.
Pads need no mask here:
`chunk_prepare` made them neutral (zero rows of w, u, qg, kg and A). With `slots` the initial
and final states live in a pool [S, H, K, V] read and written at each row's slot (in place).

Packed (`seq_info`): one stream (B = 1) holds N sequences, each over a contiguous range of
whole chunks. One program per (sequence, head, V tile) walks its sequence's chunks only,
starting from that sequence's state and writing its final state back; optionally it also writes
the state after every `prefix_chunks` chunks (prefix states). Chunks outside every range are
not read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.chunk_prepare import ChunkIntermediates

__all__ = ["ScanBlockSizes", "chunk_scan"]

f32 = jnp.float32
_FILL_PROGRAMS = 256  # about two programs per H200 SM (132)


@dataclasses.dataclass(frozen=True)
class ScanBlockSizes:
    """Tiling of `chunk_scan`.

    Attributes:
      block_v: BV, the state columns per program (a power of two dividing V, >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth of the chunk loop's loads.
    """

    block_v: int
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def get_default(batch: int, heads: int, v: int, chunk: int) -> ScanBlockSizes:
        """The fastest tilings measured on the H200 (4 warps throughout):
        - BV 64 (or V) with 2 stages when that gives B*H*(V/BV) >= 256 programs, two per SM:
          the other program on the SM hides each trip's load latency.
        - Fewer programs, C <= 32: BV 32 (or V) with 3 stages, which keep two chunks' loads in
          flight (60-68 KB of shared memory); with 2, the next chunk's loads are issued at the
          end of a trip and waited on at the top of the next, so their latency is paid every
          trip.
        - Fewer programs, C = 64: two chunks' loads fit beside each other for one program per
          SM only, so 2 stages, and BV halved down to 16 until there are >= 256 programs.
        """
        bv = min(v, 64)
        if batch * heads * (v // bv) >= _FILL_PROGRAMS:
            return ScanBlockSizes(block_v=bv, num_warps=4, num_stages=2)
        if chunk <= 32:
            return ScanBlockSizes(block_v=min(v, 32), num_warps=4, num_stages=3)
        while bv > 16 and batch * heads * (v // bv) < _FILL_PROGRAMS:
            bv //= 2
        return ScanBlockSizes(block_v=bv, num_warps=4, num_stages=2)


def _chunk_scan_kernel(
    qg_ref,  # [N*C, K]
    kg_ref,  # [N*C, K]
    w_ref,  # [N*C, K]
    u_ref,  # [N*C, BV] fp32
    a_ref,  # [N*C, C]
    gl_ref,  # [N, K] fp32
    s_ref,  # [K, BV] fp32; pooled: the whole pool [S, H, K, V]
    *refs,  # pooled: slot [1]; packed: info [4]; nan_state: flag [1]; o [N*C, BV]; new state
    # [K, BV] fp32 (pooled: the pool, aliased); packed with prefix_chunks: prefix states
    # [M, H, K, V] fp32
    chunk: int,
    pooled: bool,
    packed: bool = False,
    prefix_chunks: int = 0,
    save: bool = False,
    nan_state: bool = False,
):
    """One (sequence, head, V tile): the chunks in order, the state tile in registers. Pooled,
    the state tile is pool[slot, h, :, tile j], read and written back in place; a negative slot
    reads slot 0 (in bounds) and writes nothing. Packed, the sequence's chunks are
    info = (first chunk, end chunk, first prefix row, prefix rows) of the stream; with
    `prefix_chunks` the state after every prefix_chunks of them goes to the next prefix row,
    as long as rows remain. With `save` (training) it also writes the state before each chunk
    and each chunk's Delta, what the backward pass (`chunk_vjp`) reads. With `nan_state`
    a non-zero flag stores the final state tile as NaN (a row with a non-finite real token)."""
    refs = list(refs)
    slot_ref = refs.pop(0) if pooled else None
    info_ref = refs.pop(0) if packed else None
    flag_ref = refs.pop(0) if nan_state else None
    o_ref, s_out_ref, *p_refs = refs
    if save:
        hs_ref, delta_ref = p_refs
    tile = (Ellipsis,)
    bv = o_ref.shape[-1]
    if pooled:
        slot = slot_ref[0]
        tile = (
            jnp.maximum(slot, 0),
            pl.program_id(1),
            slice(None),
            pl.ds(pl.program_id(2) * bv, bv),
        )
    if prefix_chunks:  # read here: interpret mode cannot see program_id inside pl.when
        hh, jj = pl.program_id(1), pl.program_id(2)
    mm = qg_ref.dtype
    n_chunks = gl_ref.shape[0]
    lo, hi = (info_ref[0], info_ref[1]) if packed else (0, n_chunks)
    nt = (((1,), (1,)), ((), ()))  # x @ y.T
    tn = (((0,), (0,)), ((), ()))  # x.T @ y

    def step(n, s_t):
        rows = pl.ds(n * chunk, chunk)
        s_mm = s_t.astype(mm)  # S^T [BV, K]
        w_s = lax.dot_general(w_ref[rows, :], s_mm, nt, preferred_element_type=f32)
        delta = u_ref[rows, :].astype(f32) - w_s  # [C, BV]
        if save:
            hs_ref[n] = s_t.T
            delta_ref[rows, :] = delta
        # Delta as a sum of mm-dtype parts (hi + lo for bf16: ~16 mantissa bits), so the
        # products with A and kg do not round the delta-rule errors to bf16.
        d_parts = [delta.astype(mm)]
        if mm != f32:
            d_parts.append((delta - d_parts[0].astype(f32)).astype(mm))
        a, kg = a_ref[rows, :], kg_ref[rows, :]
        o = lax.dot_general(qg_ref[rows, :], s_mm, nt, preferred_element_type=f32)
        s_t = gl_ref[pl.ds(n, 1), :] * s_t  # decay rows of S (columns of S^T) by exp(G_last)
        for d in d_parts:
            o += jnp.dot(a, d, preferred_element_type=f32)
            s_t += lax.dot_general(d, kg, tn, preferred_element_type=f32)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        if prefix_chunks:
            done = n + 1 - lo  # chunks of the sequence through this one
            row = done // prefix_chunks - 1

            @pl.when((done % prefix_chunks == 0) & (row < info_ref[3]))
            def _():
                p_refs[0][info_ref[2] + row, hh, :, pl.ds(jj * bv, bv)] = s_t.T

        return s_t

    s_t = lax.fori_loop(lo, hi, step, s_ref[tile].astype(f32).T)
    if nan_state:
        s_t = jnp.where(flag_ref[0] != 0, jnp.full_like(s_t, jnp.nan), s_t)
    if pooled:

        @pl.when(slot >= 0)
        def _():
            s_out_ref[tile] = s_t.T

    else:
        s_out_ref[...] = s_t.T


@functools.partial(
    jax.jit,
    static_argnames=(
        "t",
        "out_dtype",
        "block_sizes",
        "prefix_chunks",
        "prefix_rows",
        "save_states",
        "interpret",
    ),
)
def chunk_scan(
    inter: ChunkIntermediates,
    state: jax.Array,
    slots: jax.Array | None = None,
    *,
    t: int,
    out_dtype=f32,
    block_sizes: ScanBlockSizes | None = None,
    seq_info: jax.Array | None = None,
    prefix_chunks: int = 0,
    prefix_rows: int = 0,
    save_states: bool = False,
    nan_state: jax.Array | None = None,
    interpret: bool | None = None,
):
    """The chunk-by-chunk state pass over `chunk_prepare`'s intermediates.

    Args:
      inter: ChunkIntermediates (qg, kg, w [B, H, N*C, K]; u [B, H, N*C, V]; a [B, H, N*C, C];
        gl [B, H, N, K] fp32).
      state: [B, H, K, V] fp32 initial state.
      slots: [B] int32 or None. When given, state is a pool [S, H, K, V]: row b starts from
        pool[slots[b]] and its final state is written there, in place when the caller donates
        the pool; a negative slot writes nothing. Non-negative slots must be distinct.
      t: T, the number of token rows of o (T <= N*C; rows past T are dropped).
      out_dtype: dtype of o.
      block_sizes: tiling (default `ScanBlockSizes.get_default(B, H, V, C)`).
      seq_info: packed mode: [Q, 4] int32 for Q sequences in one stream (B = 1), per sequence
        (first chunk, end chunk, first prefix row, prefix rows): its chunks [first, end) of
        the stream, disjoint between sequences. Sequence q starts from state[q] (state
        [Q, H, K, V], or pool[slots[q]] with slots [Q]) and its final state is written there;
        rows of o in no sequence's chunks are left unwritten (undefined).
      prefix_chunks, prefix_rows: packed mode, static: with prefix_chunks > 0, the state after
        every prefix_chunks chunks of sequence q goes to rows first prefix row, +1, ... of a
        third output [prefix_rows, H, K, V], as many as its info allows; other rows undefined.
      save_states: also return what the backward pass reads (dense rows only): the state
        before each chunk hs [B, H, N, K, V] fp32 and Delta = u - w S [B, H, N*C, V] fp32.
      nan_state: optional [B] bool (packed: [Q], one per sequence): rows whose final state is
        written as NaN, in the kernel's own store (with slots, at the row's slot): the rows
        whose real tokens include a non-finite one, with no second pass over the states.
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      o: [B, T, H, V] out_dtype (0 at pads); new_state: [B, H, K, V] fp32 (with slots, the
      pool; packed, [Q, H, K, V] or the pool); packed with prefix_chunks, also the prefix
      states; with save_states, also hs and Delta.
    """
    bsz, h, tp, kd = inter.qg.shape
    vd = inter.u.shape[-1]
    n = inter.gl.shape[2]
    chunk = tp // n
    packed = seq_info is not None
    if packed:
        if bsz != 1 or seq_info.ndim != 2 or seq_info.shape[1] != 4:
            raise ValueError(
                f"chunk_scan: packed mode takes one stream and seq_info [Q, 4], got B={bsz} and "
                f"seq_info of shape {seq_info.shape}"
            )
        if prefix_chunks < 0 or (prefix_chunks == 0) != (prefix_rows == 0) or prefix_rows < 0:
            raise ValueError(
                f"chunk_scan: {prefix_chunks=} and {prefix_rows=}: expected both 0, or both > 0"
            )
    elif prefix_chunks or prefix_rows:
        raise ValueError("chunk_scan: prefix states need packed mode (seq_info)")
    if save_states and (packed or slots is not None):
        raise ValueError("chunk_scan: save_states takes dense rows (no seq_info, no slots)")
    seqs = seq_info.shape[0] if packed else bsz
    if nan_state is not None and tuple(nan_state.shape) != (seqs,):
        raise ValueError(
            f"chunk_scan: nan_state of shape {tuple(nan_state.shape)}: expected [{seqs}] (one "
            "flag per " + ("sequence of seq_info)" if packed else "row)")
        )
    rows = seqs if slots is None else state.shape[0]
    if tuple(state.shape) != (rows, h, kd, vd):
        raise ValueError(f"chunk_scan: state has shape {state.shape}, expected {(rows, h, kd, vd)}")
    if slots is not None and (
        slots.shape != (seqs,) or not jnp.issubdtype(slots.dtype, jnp.integer)
    ):
        raise ValueError(
            f"chunk_scan: slots has shape {slots.shape} and dtype {slots.dtype}, expected [{seqs}] "
            "integers"
        )
    if not n * chunk - chunk < t <= n * chunk:
        raise ValueError(f"chunk_scan: t={t} does not fit N={n} chunks of C={chunk} tokens")
    blk = block_sizes or ScanBlockSizes.get_default(seqs, h, vd, chunk)
    bv = blk.block_v
    if bv < 16 or bv & (bv - 1) or vd % bv:
        raise ValueError(f"chunk_scan: block_v={bv}: expected a power of two >= 16 dividing V={vd}")
    # Packed, every program reads the one stream (row 0) and writes its own chunks' rows of o.
    row_of = (lambda s: 0) if packed else (lambda s: s)  # noqa: E731
    whole = lambda d: pl.BlockSpec(  # noqa: E731
        (None, None, tp, d), lambda s, hh, j: (row_of(s), hh, 0, 0)
    )
    vtile = pl.BlockSpec((None, None, tp, bv), lambda s, hh, j: (row_of(s), hh, 0, j))
    state_spec = pl.BlockSpec((None, None, kd, bv), lambda s, hh, j: (s, hh, 0, j))
    pool_in, pool_spec, aliases = (), [], {}
    if slots is not None:  # the whole pool, reached at each row's slot in the kernel
        state_spec = pl.no_block_spec
        pool_in, pool_spec = (slots.astype(jnp.int32),), [pl.BlockSpec((1,), lambda s, hh, j: (s,))]
        aliases = {6: 1}
    if packed:
        pool_in += (seq_info.astype(jnp.int32),)
        pool_spec.append(pl.BlockSpec((None, 4), lambda s, hh, j: (s, 0)))
    if nan_state is not None:
        pool_in += (nan_state.astype(jnp.int32),)
        pool_spec.append(pl.BlockSpec((1,), lambda s, hh, j: (s,)))
    prefix_shape, prefix_spec = (), ()
    if prefix_chunks:
        prefix_shape = (jax.ShapeDtypeStruct((prefix_rows, h, kd, vd), f32),)
        prefix_spec = (pl.no_block_spec,)
    if save_states:
        prefix_shape = (
            jax.ShapeDtypeStruct((bsz, h, n, kd, vd), f32),
            jax.ShapeDtypeStruct((bsz, h, tp, vd), f32),
        )
        prefix_spec = (
            pl.BlockSpec((None, None, n, kd, bv), lambda s, hh, j: (s, hh, 0, 0, j)),
            pl.BlockSpec((None, None, tp, bv), lambda s, hh, j: (s, hh, 0, j)),
        )
    kernel = functools.partial(
        _chunk_scan_kernel,
        chunk=chunk,
        pooled=slots is not None,
        save=save_states,
        nan_state=nan_state is not None,
    )
    if packed:
        kernel = functools.partial(kernel, packed=True, prefix_chunks=prefix_chunks)
    o, new_state, *prefix = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, tp, h, vd), out_dtype),
            jax.ShapeDtypeStruct(state.shape, f32),
            *prefix_shape,
        ),
        grid=(seqs, h, vd // bv),
        in_specs=[
            whole(kd),
            whole(kd),
            whole(kd),
            vtile,
            whole(chunk),
            pl.BlockSpec((None, None, n, kd), lambda s, hh, j: (row_of(s), hh, 0, 0)),
            state_spec,
            *pool_spec,
        ],
        out_specs=(
            pl.BlockSpec((None, tp, None, bv), lambda s, hh, j: (row_of(s), 0, hh, j)),
            state_spec,
            *prefix_spec,
        ),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        input_output_aliases=aliases,
        name="kda_chunk_scan",
        interpret=common.resolve_interpret(interpret),
    )(inter.qg, inter.kg, inter.w, inter.u, inter.a, inter.gl, state.astype(f32), *pool_in)
    o = o if tp == t else o[:, :t]
    return (o, new_state, *prefix)
