"""Chunked prefill core (SPEC §5) on the Triton backend: the algorithm, stage by stage.

    raw q, k, v, f, b  --chunk_prepare-->  qg, kg, w, u, A, exp(G_last)   (intra-chunk, parallel)
                       --chunk_scan----->  o, final state                 (state pass over chunks)
                       --o_norm_gate---->  y = RMSNorm(o) * w * sigmoid(g_a g_b^T), 0 at pads

chunk_prepare is itself three kernels (chunk_diag, chunk_intra, chunk_wu). Each stage takes its
default tiling here; the stages' own functions take a `block_sizes` to try others.

`chunk_kda` is the core without the norm (what FLA's `chunk_kda` computes once q, k are
normalised); `prefill_core` is the block's stage, with the signature and semantics of
`reference.prefill_core_reference`.

Packed sequences (`chunk_kda_packed`, `prefill_core_packed`) run the same kernels over one
stream (B = 1) in which each sequence occupies whole chunks: chunk_prepare is unchanged and sees
one long sequence, whose rows outside the sequences' tokens are made neutral through their gate
and beta logits (-inf gives g = 0 and beta = 0 exactly, for both gates); chunk_scan runs one
program per sequence over its own chunks (`seq_info`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.chunk_prepare import chunk_prepare
from pallas_kernels.chunk_scan import chunk_scan
from pallas_kernels.o_norm import o_norm_gate

__all__ = ["chunk_kda", "chunk_kda_packed", "prefill_core", "prefill_core_packed"]

f32 = jnp.float32
# The gate and beta logit of a neutral row: gate_math gives g = -0 (decay 1) for both gates and
# beta_math gives beta = 0, exactly, so the row leaves the state alone.
NEUTRAL_LOGIT = -jnp.inf


def matmul_dtype(out_dtype) -> jnp.dtype:
    """Storage and product dtype of the chunk intermediates: bf16 unless the block runs in fp32."""
    return jnp.dtype(f32) if jnp.dtype(out_dtype) == f32 else jnp.dtype(jnp.bfloat16)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "chunk", "lower_bound", "mm_dtype", "o_dtype", "l2_eps", "interpret"),
)
def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    state: jax.Array,
    lengths: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    mm_dtype=jnp.bfloat16,
    o_dtype=f32,
    l2_eps: float | None = None,
    slots: jax.Array | None = None,
    nan_state: jax.Array | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gate, beta and the chunked delta rule over T padded tokens (no output norm).

    Args:
      q, k: [B, T, H, K] L2-normalised (q unscaled); v: [B, T, H, V]; any float dtype.
      f: [B, T, H*K] raw gate input; b: [B, T, H] beta logits.
      state: [B, H, K, V] fp32; lengths: [B] int32 in [0, T] (pads may hold anything).
      a_log: [H]; dt_bias: [H*K]; scale: s; chunk: C; lower_bound: lb or None (unbounded).
      mm_dtype: dtype of the intermediates and of the products' operands; o_dtype: dtype of o.
      l2_eps: set when q, k arrive raw: they are L2-normalised inside chunk_prepare.
      slots: [B] int32 or None: state is then a pool [S, H, K, V] read and written at slots[b]
        by the state pass (`chunk_scan`); a negative slot writes nothing.
      nan_state: optional [B] bool: rows whose final state is NaN (written so by the scan).
      interpret: run the kernels in Pallas interpret mode (None: when there is no GPU).
    Returns:
      o: [B, T, H, V] o_dtype, 0 at pads; new_state: [B, H, K, V] fp32.
    """
    inter = chunk_prepare(
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
        interpret=interpret,
    )
    return chunk_scan(
        inter,
        state,
        slots,
        t=q.shape[1],
        out_dtype=o_dtype,
        nan_state=nan_state,
        interpret=interpret,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "chunk", "lower_bound", "eps", "out_dtype", "interpret")
)
def prefill_core(
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
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gate, beta, chunked recurrence and gated RMSNorm over T padded tokens.

    The kernel path of `reference.prefill_core_reference`: positions t >= lengths[b] leave the
    state alone and output 0 (NaN below `poison[b]`), whatever q, k, v, f, b, g_a hold there.
    o passes between the scan and the norm in the intermediates' dtype (bf16 unless the block
    runs in fp32): the norm's input needs no more than its output keeps. The norm forms the
    output gate z = g_a g_b^T (+ g_bias) per tile (`o_norm_gate`): z is never written.

    Args:
      q, k, v: [B, T, H, K] from conv_prefill (q, k L2-normalised).
      f: [B, T, P]; b: [B, T, H]; state: [B, H, K, V] fp32; lengths: [B] int32.
      g_a: [B, T, R]; g_b: [P, R]; g_bias: optional [P]: the output gate's projection.
      a_log: [H]; dt_bias: [P]; o_norm_w: [V].
      poison: optional [B] int32 >= lengths, as in the reference.
      slots: [B] int32 or None: state is then a pool [S, H, K, V] read and written in place
        at slots[b]; a negative slot writes nothing (give its row length 0).
      nan_state: optional [B] bool, as in the reference: rows whose final state is NaN.
      interpret: run the kernels in Pallas interpret mode (None: when there is no GPU).
    Returns:
      y: [B, T, P] out_dtype; new_state: [B, H, K, V] fp32 (with slots, the pool).
    """
    t = q.shape[1]
    o, new_state = chunk_kda(
        q,
        k,
        v,
        f,
        b,
        state,
        lengths,
        a_log,
        dt_bias,
        scale=scale,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=matmul_dtype(out_dtype),
        o_dtype=matmul_dtype(out_dtype),
        slots=slots,
        nan_state=nan_state,
        interpret=interpret,
    )
    keep = common.output_keep(lengths, t, poison)  # g_a may be NaN at pads: replaced, not scaled
    y = o_norm_gate(
        o,
        g_a,
        g_b,
        o_norm_w,
        keep,
        eps=eps,
        g_bias=g_bias,
        out_dtype=out_dtype,
        interpret=interpret,
    )
    return y, new_state


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "chunk",
        "lower_bound",
        "mm_dtype",
        "o_dtype",
        "l2_eps",
        "prefix_chunks",
        "prefix_rows",
        "interpret",
    ),
)
def chunk_kda_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    state: jax.Array,
    seq_info: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    mm_dtype=jnp.bfloat16,
    o_dtype=f32,
    l2_eps: float | None = None,
    slots: jax.Array | None = None,
    nan_state: jax.Array | None = None,
    prefix_chunks: int = 0,
    prefix_rows: int = 0,
    interpret: bool | None = None,
):
    """`chunk_kda` over one stream holding Q sequences, each on its own range of whole chunks.

    Args:
      q, k, v: [1, S, H, K] (S a multiple of C); f: [1, S, H*K]; b: [1, S, H]. Rows inside a
        sequence's chunks but past its tokens must be neutral: f = b = NEUTRAL_LOGIT (-inf)
        and q, k, v finite. Rows in no sequence's chunks are never read by the state pass.
      state: [Q, H, K, V] fp32, or with slots [Q] int32 a pool read and written in place at
        slots[q] (a negative slot writes nothing).
      seq_info: [Q, 4] int32 per sequence: (first chunk, end chunk, first prefix row, prefix
        rows), as `chunk_scan` takes it.
      nan_state: optional [Q] bool: sequences whose final state is NaN (written so by the scan).
      prefix_chunks, prefix_rows: as in `chunk_scan` (0: no prefix states).
      The other arguments as in `chunk_kda`.
    Returns:
      o: [1, S, H, V] o_dtype (rows in no sequence's chunks undefined); new_state; with
      prefix_chunks, the prefix states [prefix_rows, H, K, V] (rows not written undefined).
    """
    s_len = q.shape[1]
    if s_len % chunk:
        raise ValueError(f"chunk_kda_packed: S={s_len} rows, expected a multiple of C={chunk}")
    inter = chunk_prepare(
        q,
        k,
        v,
        f,
        b,
        jnp.full((1,), s_len, jnp.int32),
        a_log,
        dt_bias,
        scale=scale,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=mm_dtype,
        l2_eps=l2_eps,
        interpret=interpret,
    )
    return chunk_scan(
        inter,
        state,
        slots,
        t=s_len,
        out_dtype=o_dtype,
        seq_info=seq_info,
        prefix_chunks=prefix_chunks,
        prefix_rows=prefix_rows,
        nan_state=nan_state,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "chunk",
        "lower_bound",
        "eps",
        "out_dtype",
        "prefix_block",
        "prefix_rows",
        "interpret",
    ),
)
def prefill_core_packed(
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
    interpret: bool | None = None,
):
    """The kernel path of `reference.prefill_core_packed_reference`: rows with valid = False
    get neutral gate and beta logits and output 0, whatever f, b and g_a hold there; q, k, v
    must be finite there (the conv's output on finite inputs is). The norm forms the output
    gate z = g_a g_b^T (+ g_bias) per tile (`o_norm_gate`), as `prefill_core`'s does.

    Args:
      q, k, v: [S, H, K] from conv_prefill over the stream; f: [S, P]; b: [S, H];
      g_a: [S, R]; g_b: [P, R]; g_bias: optional [P];
      state, valid, seq_info, slots, nan_state, prefix_block, prefix_rows: as in the reference.
    Returns:
      y: [S, P] out_dtype; new_state; prefix states [prefix_rows, H, K, V] or None (rows past
      the sequences' own undefined: the caller selects).
    """
    one = lambda a: a[None]  # noqa: E731 - the stream as a batch of one
    neutral = lambda a: jnp.where(valid[:, None], a, jnp.asarray(NEUTRAL_LOGIT, a.dtype))  # noqa: E731
    mm = matmul_dtype(out_dtype)
    o, new_state, *prefix = chunk_kda_packed(
        one(q),
        one(k),
        one(v),
        one(neutral(f)),
        one(neutral(b)),
        state,
        seq_info,
        a_log,
        dt_bias,
        scale=scale,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=mm,
        o_dtype=mm,
        slots=slots,
        nan_state=nan_state,
        prefix_chunks=prefix_block // chunk if prefix_rows else 0,
        prefix_rows=prefix_rows,
        interpret=interpret,
    )
    keep = valid.astype(f32)  # o is undefined in chunks no sequence holds: replaced, not scaled
    y = o_norm_gate(
        o,
        one(g_a),
        g_b,
        o_norm_w,
        one(keep),
        eps=eps,
        g_bias=g_bias,
        out_dtype=out_dtype,
        interpret=interpret,
    )
    return y[0], new_state, (prefix[0] if prefix else None)
