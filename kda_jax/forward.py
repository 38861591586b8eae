"""The block's forward (SPEC §1, §3): `prefill`, `decode`, `decode_k`, written once.

Each entry point checks its arguments (SPEC §10), then runs a jitted pure function of (params,
cfg, inputs, state) with `cfg`, `backend`, `interpret` and `return_stages` static. The backend is
resolved in `kda_jax.backends` and supplies the stage functions; nothing here depends on which
one runs.

Every entry point takes `slots`: `state` is then a pool of N sequences and row b of the batch
reads and writes pool row `slots[b]` (the pallas kernels in place, the xla backend by gather and
scatter); the whole pool comes back with only those rows changed. Slot -1 marks a padding row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import backends
from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, in_proj_slices
from kda_jax.state import KdaState, concrete
from pallas_kernels import reference as ref

__all__ = ["prefill", "decode", "decode_k"]

_STATIC = ("cfg", "backend", "interpret", "return_stages", "precision")
# Batches up to this many rows find repeated slots by comparing every pair (one fusion); larger
# ones by a sort.
_PAIRWISE_ROWS = 1024


def _check_cfg(cfg, what: str) -> None:
    """Before jit sees cfg as a static argument: it must be a (valid, hashable) KdaConfig."""
    if not isinstance(cfg, KdaConfig):
        raise TypeError(f"{what}: cfg is a {type(cfg).__name__}, expected a KdaConfig")
    cfg.validate()


def _check_inputs(
    params, cfg: KdaConfig, x, state: KdaState, rank: int, what: str, pooled: bool = False
) -> None:
    """Every check an entry point makes before any work: params, x, state (for B sequences, or
    with `pooled` a pool of N >= 1)."""
    if not isinstance(params, KdaParams):
        raise TypeError(f"{what}: params is a {type(params).__name__}, expected a KdaParams")
    params.check(cfg)
    if not isinstance(state, KdaState):
        raise TypeError(f"{what}: state is a {type(state).__name__}, expected a KdaState")
    if x.ndim != rank or x.shape[-1] != cfg.hidden:
        want = {2: "[B, D]", 3: "[B, T, D]" if what == "prefill" else "[B, k, D]"}[rank]
        raise ValueError(
            f"{what}: x has shape {tuple(x.shape)}, expected {want} with D = hidden = {cfg.hidden}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{what}: x has dtype {x.dtype}, expected a floating dtype")
    if pooled:
        n = np.shape(state.recurrent)[0] if np.ndim(state.recurrent) else 0
        if n < 1:
            raise ValueError(
                f"{what}: the state pool has shape {np.shape(state.recurrent)}, expected "
                "[N, H, K, V] with N >= 1 slots"
            )
        state.check(cfg, n)
    else:
        state.check(cfg, x.shape[0])


def _check_slots(slots, b_: int, state, what: str) -> jax.Array | None:
    """slots as [B] int32. Concrete values outside [-1, N) or a slot named by two rows raise;
    traced ones are handled by `_slot_codes`."""
    if slots is None:
        return None
    slots = jnp.asarray(slots)
    if slots.shape != (b_,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(
            f"{what}: slots has shape {slots.shape} and dtype {slots.dtype}, expected [{b_}] "
            "integers (one pool slot per row)"
        )
    vals = concrete(slots)  # None under jit
    rec = getattr(state, "recurrent", None)
    if vals is not None and np.ndim(rec):
        n = np.shape(rec)[0]
        out = (vals < -1) | (vals >= n)
        if out.any():
            raise ValueError(
                f"{what}: slots hold {vals[out].tolist()}, expected values in [-1, N={n}) "
                "(-1 marks a padding row)"
            )
        real, counts = np.unique(vals[vals >= 0], return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"{what}: slots {real[counts > 1].tolist()} are named by more than one row, "
                "expected each slot at most once"
            )
    return slots.astype(jnp.int32)


def _slot_codes(slots: jax.Array, n: int) -> jax.Array:
    """The kernels' slot codes under jit, where `_check_slots` cannot see values: a row whose
    slot lies outside [-1, N) or repeats an earlier row's slot becomes -2 (the row reads and
    writes nothing and its outputs are NaN); -1 (padding) and valid slots pass."""
    bad = (slots < -1) | (slots >= n)
    b_ = slots.shape[0]
    if 1 < b_ <= _PAIRWISE_ROWS:
        rows = jnp.arange(b_)
        same = (slots[:, None] == slots[None, :]) & (rows[None, :] < rows[:, None])
        bad |= (slots >= 0) & same.any(axis=1)
    elif b_ > _PAIRWISE_ROWS:
        order = jnp.argsort(slots, stable=True)  # equal slots in row order
        s_ = slots[order]
        again = jnp.concatenate([jnp.zeros((1,), bool), (s_[1:] == s_[:-1]) & (s_[1:] >= 0)])
        bad |= jnp.zeros((b_,), bool).at[order].set(again)
    return jnp.where(bad, -2, slots)


def _check_backend(backend: str, what: str) -> None:
    """The pallas backend's envelope, checked before tracing any kernel."""
    if backend != "pallas":
        return
    if jax.config.jax_enable_x64:
        raise NotImplementedError(
            f"{what}: the pallas backend does not run with jax_enable_x64 on (its kernels index "
            "in int32); use backend='xla' or turn x64 off"
        )


@jax.custom_jvp
def _refuse_grad(tree):
    """Identity whose derivative raises: the pallas kernels have no VJP yet."""
    return tree


@_refuse_grad.defjvp
def _refuse_grad_jvp(primals, tangents):
    raise NotImplementedError(
        "the pallas backend has no gradient yet (its kernels define no VJP); differentiate "
        "through backend='xla'"
    )


def _in_proj(st: backends.Stages, params: KdaParams, cfg: KdaConfig, x: jax.Array):
    """w_in's product for x [N, D], in one sweep handing back its parts as separate arrays (no
    slice copies): q|k|v raw [N, 3P], f_a [N, K], g_a [N, K], b [N, H]."""
    sl = in_proj_slices(cfg)
    widths = (cfg.conv_dim, *(sl[n].stop - sl[n].start for n in ("f_a", "g_a", "b")))
    return st.proj(x.astype(params.dtype), params.w_in, splits=widths)


def _heads(cfg: KdaConfig, a: jax.Array) -> jax.Array:
    """[..., P] -> [..., H, K] (a free reshape)."""
    return a.reshape(*a.shape[:-1], cfg.heads, cfg.head_dim)


def _rows(
    params, cfg, x, state, slots, backend, interpret, snapshots, return_stages, precision=None
):
    """R rows per sequence through the decode path; shared by `decode` and `decode_k`. Any
    B * R: past the decode kernels' largest row tile the projections are XLA's GEMMs."""
    backend = backends.resolve(backend)
    b_, r, d = x.shape
    _check_backend(backend, "decode_k" if snapshots else "decode")
    if b_ == 0:
        return _empty_rows(params, cfg, x, state, snapshots, return_stages)
    if backend == "pallas":
        params, x, state = _refuse_grad((params, x, state))
    codes = None if slots is None else _slot_codes(slots, state.recurrent.shape[0])
    st = backends.stages(backend, interpret=interpret, precision=precision)
    qkv, f_a, g_a, b = _in_proj(st, params, cfg, x.reshape(b_ * r, d))
    shape = lambda a: a.reshape(b_, r, a.shape[-1])  # noqa: E731
    qkv = shape(qkv)
    # The conv and f_b | g_b both read w_in's output only: one launch on the kernel path.
    qkv_out, conv_state, conv_snaps, (f, z) = st.decode_front(
        qkv,
        state.conv,
        params.conv_w,
        (f_a, g_a),
        (params.f_b, params.g_b),
        qk_channels=cfg.qk_channels,
        head_dim=cfg.head_dim,
        l2_eps=cfg.l2_eps,
        splits=(cfg.qkv_dim,) * 3,  # q, k, v written apart by the kernel: no slice copies
        snapshots=snapshots,
        slots=codes,
        biases=(None, params.g_bias),
    )
    q, k, v = (_heads(cfg, a) for a in qkv_out)
    f, b, z = shape(f), shape(b), shape(z)
    y, rec, rec_snaps = st.decode_core(
        q,
        k,
        v,
        f,
        b,
        z,
        state.recurrent,
        params.a_log,
        params.dt_bias,
        params.o_norm_w,
        scale=cfg.scale,
        lower_bound=cfg.gate_lower_bound,
        eps=cfg.rms_norm_eps,
        snapshots=snapshots,
        out_dtype=params.dtype,
        slots=codes,
    )
    out = st.proj(y.reshape(b_ * r, cfg.qkv_dim), params.o_proj).reshape(b_, r, cfg.hidden)
    if codes is not None:  # padding rows 0, refused rows NaN, whatever their x held
        out = ref.slot_fill(codes, out)
    new_state = KdaState(recurrent=rec, conv=conv_state)
    snaps = KdaState(recurrent=rec_snaps, conv=conv_snaps) if snapshots else None
    stages = None
    if return_stages:
        stages = dict(qkv_proj=qkv, q=q, k=k, v=v, g_raw=f, out_gate=z, o_norm_out=y, final_out=out)
    return out, new_state, snaps, stages


def _empty_rows(params, cfg, x, state, snapshots, return_stages):
    """An empty batch: nothing to compute."""
    b_, r, _ = x.shape
    out = jnp.zeros((b_, r, cfg.hidden), params.dtype)
    snaps = None
    if snapshots:
        snaps = jax.tree.map(lambda a: jnp.zeros((b_, r, *a.shape[1:]), a.dtype), state)
    stages = {} if return_stages else None
    return out, state, snaps, stages


def decode(
    params: KdaParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    *,
    slots: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """One token per sequence, at any batch size B.

    Args:
      params: the block's weights; cfg: its config (static).
      x: [B, D] input-layernorm output of the new token.
      state: KdaState for B sequences, or with `slots` a pool of N >= 1.
      slots: [B] int (traced) or None: row b reads and writes pool slot slots[b] and the whole
        pool is returned, only those slots changed (on the pallas backend the kernels work on
        the pool in place when it is donated; no gathered copy). Slot -1 marks a padding row:
        nothing written, output 0. Concrete slots outside [-1, N) or named twice are refused;
        under jit such a row (a repeat: every row after the first naming the slot) writes
        nothing and outputs NaN.
      backend: "xla" or "pallas" (static); None picks "pallas" on a GPU, "xla" elsewhere.
      interpret: the pallas kernels' mode (static): None runs them compiled on a GPU and in
        interpret mode elsewhere; False forces compiled kernels (e.g. cross-lowering for a
        GPU from a CPU). The xla backend takes None only.
      return_stages: also return a dict of intermediates named as the oracle's stages.
      precision: of the xla backend's projections (static; "highest" or None: IEEE fp32 for
        fp32 weights; "default": the device's fastest, TF32 on a GPU). The compute dtype is the
        matrices' dtype: cast them with `params.astype(dtype)` for mixed precision.
    Returns:
      (y [B, D] in the weights' dtype, new state) and the stage dict when asked.
    """
    _check_cfg(cfg, "decode")
    slots = _check_slots(slots, np.shape(x)[0] if np.ndim(x) else -1, state, "decode")
    return _decode(
        params,
        cfg,
        x,
        state,
        slots,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(params, cfg, x, state, slots, *, backend, interpret, return_stages, precision):
    _check_inputs(params, cfg, x, state, 2, "decode", slots is not None)
    y, new_state, _, stages = _rows(
        params, cfg, x[:, None], state, slots, backend, interpret, False, return_stages, precision
    )
    y = y[:, 0]
    if return_stages:
        return y, new_state, jax.tree.map(lambda a: a[:, 0], stages)
    return y, new_state


def decode_k(
    params: KdaParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    *,
    slots: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """Speculative verify: k tokens per sequence, projections in one weight sweep (any B * k;
    above 64 rows the projections are XLA's GEMMs).

    Args:
      x: [B, k, D] with 1 <= k <= cfg.max_verify.
      slots: as in `decode` (the pool is updated after row k-1; snapshots are for the B rows;
        a padding row's snapshots are 0, a refused row's NaN).
    Returns:
      y [B, k, D]; the state after the last row; snapshots, a KdaState whose leaves carry a row
      axis ([B, k, H, K, V] and [B, k, W-1, conv_dim]): the state after each row. A caller that
      accepts a of the k tokens resumes from `select_snapshot(snapshots, a - 1)`.
    On the pallas backend, compiled, the results equal k serial `decode` calls bit for bit when
    B * k <= 8 (`pallas_kernels.gemv.MAX_KERNEL_ROWS`: the projections' rows share one tiling),
    with or without slots; with more rows, and in interpret mode (XLA's CPU compiler contracts
    multiply-adds per call site), they agree within fp32 rounding.
    """
    _check_cfg(cfg, "decode_k")
    slots = _check_slots(slots, np.shape(x)[0] if np.ndim(x) else -1, state, "decode_k")
    return _decode_k(
        params,
        cfg,
        x,
        state,
        slots,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_k(params, cfg, x, state, slots, *, backend, interpret, return_stages, precision):
    _check_inputs(params, cfg, x, state, 3, "decode_k", slots is not None)
    k = x.shape[1]
    if not 1 <= k <= cfg.max_verify:
        raise ValueError(f"decode_k: k={k} rows, expected 1 <= k <= max_verify={cfg.max_verify}")
    y, new_state, snaps, stages = _rows(
        params, cfg, x, state, slots, backend, interpret, True, return_stages, precision
    )
    if return_stages:
        return y, new_state, snaps, stages
    return y, new_state, snaps


def prefill(
    params: KdaParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    lengths: jax.Array | None = None,
    *,
    slots: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """Chunked prefill of T padded tokens per sequence from the carried state.

    Args:
      x: [B, T, D]; T is static (one compilation per padded T).
      state: KdaState for B sequences, or with `slots` a pool of N >= 1.
      slots: as in `decode`: row b starts from pool slot slots[b] and its new state is written
        there (the chunk scan reads and writes the recurrent pool in place; the small conv
        state rows are gathered and scattered); a padding row (-1) writes nothing and outputs
        0, a row refused under jit outputs NaN and writes nothing.
      lengths: [B] int (traced), real tokens per row, in [0, T]; None means all T. Positions at
        or past lengths[b] touch neither the state nor any real output, whatever they hold
        (NaN included, in values and in gradients); their outputs are 0. Concrete lengths
        outside [0, T] are refused; traced ones are clipped to it.
    Returns:
      (y [B, T, D], new state) and the stage dict when asked.

    A real token whose input holds NaN or inf poisons its own row from that token on, as the
    recurrence does: its output and every later real output of the row are NaN, and so is the
    row's new state (recurrent and conv). Earlier outputs and other rows are untouched.
    """
    _check_cfg(cfg, "prefill")
    shape = np.shape(x)
    if len(shape) == 3:
        lengths = _check_lengths(lengths, shape[0], shape[1])
    slots = _check_slots(slots, shape[0] if shape else -1, state, "prefill")
    return _prefill(
        params,
        cfg,
        x,
        state,
        lengths,
        slots,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(
    params, cfg, x, state, lengths, slots, *, backend, interpret, return_stages, precision
):
    _check_inputs(params, cfg, x, state, 3, "prefill", slots is not None)
    backend = backends.resolve(backend)
    _check_backend(backend, "prefill")
    b_, t, _ = x.shape
    if lengths is None:
        lengths = jnp.full((b_,), t, jnp.int32)
    if b_ == 0 or t == 0:
        out = jnp.zeros((b_, t, cfg.hidden), params.dtype)
        return (out, state, {}) if return_stages else (out, state)
    if backend == "pallas":
        params, x, state = _refuse_grad((params, x, state))
    codes = None
    if slots is not None:
        codes = _slot_codes(slots, state.recurrent.shape[0])
        # A padding row has no real token; a refused row's every token is real and unread
        # (`ok` = 0 below), so its outputs are NaN.
        lengths = jnp.where(codes == -1, 0, jnp.where(codes == -2, t, lengths))
    # The block reads only the real tokens before a row's first non-finite one (`ok`): the
    # chunked products would otherwise carry a NaN back to earlier rows of its chunk (0 * NaN).
    pos = jnp.arange(t)[None, :]
    real = pos < lengths[:, None]
    first_bad = jnp.min(jnp.where(real & ~jnp.isfinite(x).all(-1), pos, t), axis=1)
    ok = jnp.minimum(lengths, first_bad)
    if codes is not None:
        ok = jnp.where(codes < 0, 0, ok)
    if backend == "xla":
        # Gradients flow through this backend: zero the rows the block ignores, or the
        # projections' backward would multiply their zero cotangents by NaN (dW = x^T dy).
        x = jnp.where((pos < ok[:, None])[..., None], x, 0)
    # The real tokens past `ok` output NaN. On the pallas backend o_norm writes NaN there and
    # o_proj carries it through; the xla backend selects after o_proj instead, since o_proj's
    # backward multiplies its input by the (zero) cotangents.
    poison = lengths if backend == "pallas" else None
    out, rec, conv, stages = _prefill_rows(
        params, cfg, x, state, ok, poison, codes, backend, interpret, return_stages, precision
    )
    if backend == "xla":
        out = jnp.where((real & (pos >= ok[:, None]))[..., None], jnp.nan, out)
    poisoned = ok < lengths

    def nan_rows(a):
        return jnp.where(poisoned.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.nan, a)

    if codes is None:
        new_state = KdaState(recurrent=nan_rows(rec), conv=nan_rows(conv))
    else:  # only the poisoned rows' slots are written (a scatter; the pool stays in place)
        at = jnp.where(poisoned & (codes >= 0), codes, rec.shape[0])
        rec = rec.at[at].set(jnp.nan, mode="drop")
        new_state = KdaState(recurrent=rec, conv=ref.pool_write(state.conv, codes, nan_rows(conv)))
    if return_stages:
        stages["final_out"] = out
        return out, new_state, stages
    return out, new_state


def _check_lengths(lengths, b_: int, t: int) -> jax.Array:
    """lengths as [B] int32; concrete values outside [0, T] raise, traced ones are clipped."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b_,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"prefill: lengths has shape {lengths.shape} and dtype {lengths.dtype}, "
            f"expected [{b_}] integers"
        )
    vals = concrete(lengths)  # None under jit: clipped below
    if vals is not None and ((vals < 0) | (vals > t)).any():
        raise ValueError(f"prefill: lengths {vals.tolist()} must lie in [0, T={t}]")
    return jnp.clip(lengths.astype(jnp.int32), 0, t)


def _prefill_rows(
    params, cfg, x, state, ok, poison, codes, backend, interpret, return_stages, precision=None
):
    """The block over x [B, T, D] whose tokens below `ok` are real (and finite); the others
    touch nothing and output 0, or NaN below `poison` (None: nowhere). Returns (out, recurrent
    state, conv state of the B rows, stages); with slot codes the recurrent state is the pool."""
    b_, t, _ = x.shape
    st = backends.stages(backend, interpret=interpret, precision=precision)
    qkv, f_a, g_a, b = _in_proj(st, params, cfg, x.reshape(b_ * t, -1))
    f = st.proj(f_a, params.f_b)  # the output gate's z is formed inside the core's norm
    shape = lambda a: a.reshape(b_, t, a.shape[-1])  # noqa: E731
    qkv, f, b, g_a = shape(qkv), shape(f), shape(b), shape(g_a)
    conv_out, conv_state = st.conv_prefill(
        qkv,
        state.conv if codes is None else ref.pool_rows(state.conv, codes),  # [B, W-1, C]: small
        params.conv_w,
        ok,
        qk_channels=cfg.qk_channels,
        head_dim=cfg.head_dim,
        l2_eps=cfg.l2_eps,
        splits=(cfg.qkv_dim,) * 3,  # q, k, v written apart by the kernel: no slice copies
    )
    q, k, v = (_heads(cfg, a) for a in conv_out)
    y, rec = st.prefill_core(
        q,
        k,
        v,
        f,
        b,
        g_a,
        params.g_b,
        state.recurrent,
        ok,
        params.a_log,
        params.dt_bias,
        params.o_norm_w,
        scale=cfg.scale,
        chunk=cfg.chunk,
        lower_bound=cfg.gate_lower_bound,
        eps=cfg.rms_norm_eps,
        g_bias=params.g_bias,
        out_dtype=params.dtype,
        poison=poison,
        slots=codes,
    )
    out = st.proj(y.reshape(b_ * t, cfg.qkv_dim), params.o_proj).reshape(b_, t, cfg.hidden)
    stages = None
    if return_stages:  # z for the stage list only: the core forms it inside its norm
        (z,) = st.proj_many((g_a.reshape(b_ * t, -1),), (params.g_b,), biases=(params.g_bias,))
        z = shape(z)
        stages = dict(qkv_proj=qkv, q=q, k=k, v=v, g_raw=f, out_gate=z, o_norm_out=y, final_out=out)
    return out, rec, conv_state, stages
