"""The block's forward (SPEC §1, §3): `prefill`, `decode`, `decode_k`, written once.

Each entry point checks its arguments (SPEC §10), then runs a jitted pure function of (params,
cfg, inputs, state) with `cfg`, `backend`, `interpret` and `return_stages` static. The backend is
resolved in `kda_jax.backends` and supplies the stage functions; nothing here depends on which
one runs.

Every entry point takes `slots`: `state` is then a pool of N sequences and row b of the batch
reads and writes pool row `slots[b]` (the pallas kernels in place, the xla backend by gather and
scatter); the whole pool comes back with only those rows changed. Slot -1 marks a padding row.

`prefill_packed` takes N sequences back to back in one stream of T tokens (`cu_seqlens`) and
lays them out chunk-aligned in one longer stream (`_packed_layout`), so the prefill's kernels
run over it as over one sequence.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda_jax import backends
from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, in_proj_slices
from kda_jax.state import KdaState, PrefixStates, concrete
from pallas_kernels import reference as ref

__all__ = ["prefill", "prefill_packed", "decode", "decode_k"]

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
    if 1 < b_ <= _PAIRWISE_ROWS:  # one reduction that yields the codes: one launch
        rows = jnp.arange(b_)
        s = slots[:, None]
        clash = (s == slots[None, :]) & (rows[None, :] < rows[:, None]) & (s >= 0)
        return jnp.min(jnp.where(clash | bad[:, None], -2, s), axis=1)
    if b_ > _PAIRWISE_ROWS:
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
    """Identity whose derivative raises: the pallas kernels' stage dict has no VJP."""
    return tree


@_refuse_grad.defjvp
def _refuse_grad_jvp(primals, tangents):
    raise NotImplementedError(
        "the pallas backend has no gradient with return_stages=True (the stage dict is a "
        "debugging aid); differentiate without it, or through backend='xla'"
    )


def _differentiable(body, backend: str, return_stages: bool, diff, aux):
    """body(backend, diff, aux): an entry point's work on (params, x, state) = diff and its
    integer inputs aux. On the pallas backend the kernels run forward and the VJP is the xla
    backend's (`_xla_vjp`); with return_stages pallas refuses gradients."""
    if backend != "pallas":
        return body(backend, diff, aux)
    if return_stages:
        return body(backend, _refuse_grad(diff), aux)
    return _xla_vjp(body, diff, aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _xla_vjp(body, diff, aux):
    """The pallas kernels forward; backward, `jax.vjp` of the same body on the xla references
    with the chunked core's state pass and decayed scores on Pallas kernels
    (`backends.VJP_BACKEND`), recomputed from the saved inputs. Both compute the same function
    (SPEC bars), so the gradients are the xla path's."""
    return body("pallas", diff, aux)


def _xla_vjp_fwd(body, diff, aux):
    return body("pallas", diff, aux), (diff, aux)


def _xla_vjp_bwd(body, res, ct):
    diff, aux = res
    _, pull = jax.vjp(lambda d: body(backends.VJP_BACKEND, d, aux), diff)
    return pull(ct)[0], None


_xla_vjp.defvjp(_xla_vjp_fwd, _xla_vjp_bwd)


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

    def body(backend, diff, aux):
        return _rows_body(*diff, *aux, cfg, backend, interpret, snapshots, return_stages, precision)

    return _differentiable(body, backend, return_stages, (params, x, state), (slots,))


def _rows_body(params, x, state, slots, cfg, backend, interpret, snapshots, return_stages, prec):
    """`_rows` on one backend (interpret applies to pallas only)."""
    b_, r, d = x.shape
    interpret = None if backend == "xla" else interpret
    codes = None if slots is None else _slot_codes(slots, state.recurrent.shape[0])
    st = backends.stages(backend, interpret=interpret, precision=prec)
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
    # decode_core wrote y = 0 at padding rows and NaN at refused ones, whatever their x held,
    # so o_proj carries them to the output: no select after it.
    out = st.proj(y.reshape(b_ * r, cfg.qkv_dim), params.o_proj).reshape(b_, r, cfg.hidden)
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

    def body(backend, diff, aux):
        return _prefill_body(*diff, *aux, cfg, backend, interpret, return_stages, precision)

    return _differentiable(body, backend, return_stages, (params, x, state), (lengths, slots))


def _prefill_body(
    params, x, state, lengths, slots, cfg, backend, interpret, return_stages, precision
):
    """`_prefill` on one backend (interpret applies to pallas only)."""
    b_, t, _ = x.shape
    interpret = None if backend == "xla" else interpret
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
    if backend != "pallas":
        # Gradients flow through this backend: zero the rows the block ignores, or the
        # projections' backward would multiply their zero cotangents by NaN (dW = x^T dy).
        x = jnp.where((pos < ok[:, None])[..., None], x, 0)
    # The real tokens past `ok` output NaN. On the pallas backend o_norm writes NaN there and
    # o_proj carries it through; the xla backend selects after o_proj instead, since o_proj's
    # backward multiplies its input by the (zero) cotangents.
    poison = lengths if backend == "pallas" else None
    # A row with a non-finite real token ends with NaN states: the core's state pass writes its
    # recurrent state so (at its slot in a pool), with no second pass over the states.
    poisoned = ok < lengths
    out, rec, conv, stages = _prefill_rows(
        params, cfg, x, state, ok, poison, poisoned, codes, backend, interpret, return_stages,
        precision,
    )  # fmt: skip
    if backend != "pallas":
        out = jnp.where((real & (pos >= ok[:, None]))[..., None], jnp.nan, out)
    conv = jnp.where(poisoned[:, None, None], jnp.nan, conv)  # [B, W-1, C]: small
    if codes is not None:
        conv = ref.pool_write(state.conv, codes, conv)
    new_state = KdaState(recurrent=rec, conv=conv)
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
    params, cfg, x, state, ok, poison, nan_state, codes, backend, interpret, return_stages,
    precision=None,
):  # fmt: skip
    """The block over x [B, T, D] whose tokens below `ok` are real (and finite); the others
    touch nothing and output 0, or NaN below `poison` (None: nowhere); rows with `nan_state`
    end with a NaN recurrent state. Returns (out, recurrent state, conv state of the B rows,
    stages); with slot codes the recurrent state is the pool."""
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
        nan_state=nan_state,
    )
    out = st.proj(y.reshape(b_ * t, cfg.qkv_dim), params.o_proj).reshape(b_, t, cfg.hidden)
    stages = None
    if return_stages:  # z for the stage list only: the core forms it inside its norm
        (z,) = st.proj_many((g_a.reshape(b_ * t, -1),), (params.g_b,), biases=(params.g_bias,))
        z = shape(z)
        stages = dict(qkv_proj=qkv, q=q, k=k, v=v, g_raw=f, out_gate=z, o_norm_out=y, final_out=out)
    return out, rec, conv_state, stages


# --------------------------------------------------------------------------------------------
# Packed variable-length prefill
# --------------------------------------------------------------------------------------------
_PACKED_STATIC = ("cfg", "backend", "interpret", "precision", "prefix_block")


def prefill_packed(
    params: KdaParams,
    cfg: KdaConfig,
    x: jax.Array,
    cu_seqlens: jax.Array,
    state: KdaState,
    *,
    slots: jax.Array | None = None,
    prefix_block: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    precision=None,
):
    """Prefill of N sequences packed back to back in one stream (FLA's `cu_seqlens`).

    Sequence i is x[cu_seqlens[i]:cu_seqlens[i + 1]]; it starts from its own state and its final
    state is written back; the conv and the recurrence restart at every boundary, and gradients
    stay within each sequence. No sequence is padded to the longest: the work is
    that of T tokens plus at most one chunk and W-1 rows per sequence. One compilation serves
    every cu_seqlens for a given T and N.

    Args:
      x: [T, D]; T is static.
      cu_seqlens: [N + 1] int (traced), 0 = cu[0] <= cu[1] <= ... <= cu[N] <= T. Tokens from
        cu[N] on are padding: they touch nothing and output 0, whatever they hold. Concrete
        values are checked before any work; under jit they cannot be, and are clipped to
        [0, T] and made non-decreasing (a running maximum); tokens before cu[0] are then
        padding too.
      state: KdaState for the N sequences (row i for sequence i), or with `slots` a pool.
      slots: [N] int (traced) or None: sequence i starts from pool slot slots[i] and its new
        state is written there (the chunk scan reads and writes the recurrent pool in place).
        Slot -1 marks a padding sequence: its tokens output 0 and nothing is written; slots
        are checked as in `prefill` (under jit a refused sequence outputs NaN, writes nothing).
      prefix_block: None, or a positive multiple of cfg.chunk (static): also return the state
        after every prefix_block tokens of each sequence (`PrefixStates`).
      backend, interpret, precision: as in `prefill`.
    Returns:
      (y [T, D] in the weights' dtype, new state), plus the `PrefixStates` with prefix_block.

    Non-finite inputs poison their own sequence only, as in `prefill`: from a sequence's first
    non-finite token on its outputs are NaN, and so is its new state; a non-finite carried conv
    state makes all of its outputs NaN. The carried conv state enters the stream in the
    activations' dtype (exact for states this block wrote, whose rows are past projections).
    """
    _check_cfg(cfg, "prefill_packed")
    shape = np.shape(x)
    cu_seqlens = _check_cu_seqlens(cu_seqlens, shape[0] if len(shape) == 2 else None)
    n = cu_seqlens.shape[0] - 1
    slots = _check_slots(slots, n, state, "prefill_packed")
    prefix_block = _check_prefix_block(prefix_block, cfg)
    return _prefill_packed(
        params,
        cfg,
        x,
        cu_seqlens,
        state,
        slots,
        backend=backend,
        interpret=interpret,
        precision=precision,
        prefix_block=prefix_block,
    )


def _check_cu_seqlens(cu, t: int | None) -> jax.Array:
    """cu_seqlens as [N + 1] int32; concrete values must start at 0, never decrease and end at
    or before T."""
    cu = jnp.asarray(cu)
    if cu.ndim != 1 or cu.shape[0] < 1 or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(
            f"prefill_packed: cu_seqlens has shape {cu.shape} and dtype {cu.dtype}, expected "
            "[N + 1] integers (the offsets of N >= 0 sequences)"
        )
    vals = concrete(cu)  # None under jit: clipped and made non-decreasing in _packed_tokens
    if vals is not None:
        if vals[0] != 0:
            raise ValueError(f"prefill_packed: cu_seqlens starts at {vals[0]}, expected 0")
        drop = np.flatnonzero(np.diff(vals) < 0)
        if drop.size:
            i = int(drop[0])
            raise ValueError(
                f"prefill_packed: cu_seqlens decreases at index {i + 1} ({vals[i]} -> "
                f"{vals[i + 1]}), expected non-decreasing offsets"
            )
        if t is not None and vals[-1] > t:
            raise ValueError(
                f"prefill_packed: cu_seqlens ends at {vals[-1]}, past the T={t} tokens of x"
            )
    return cu.astype(jnp.int32)


def _check_prefix_block(prefix_block, cfg: KdaConfig) -> int | None:
    """None, or a positive multiple of the chunk: prefix states are states between chunks."""
    if prefix_block is None:
        return None
    ok = isinstance(prefix_block, int | np.integer) and not isinstance(prefix_block, bool)
    if not ok or prefix_block <= 0 or prefix_block % cfg.chunk:
        raise ValueError(
            f"prefill_packed: prefix_block={prefix_block!r}, expected None or a positive "
            f"multiple of chunk={cfg.chunk} (prefix states are taken between chunks)"
        )
    return int(prefix_block)


def _check_packed_inputs(params, cfg: KdaConfig, x, state, n: int, pooled: bool) -> None:
    """`_check_inputs` for a packed stream: x [T, D], a state for N sequences or a pool."""
    if not isinstance(params, KdaParams):
        raise TypeError(
            f"prefill_packed: params is a {type(params).__name__}, expected a KdaParams"
        )
    params.check(cfg)
    if not isinstance(state, KdaState):
        raise TypeError(f"prefill_packed: state is a {type(state).__name__}, expected a KdaState")
    if x.ndim != 2 or x.shape[-1] != cfg.hidden:
        raise ValueError(
            f"prefill_packed: x has shape {tuple(x.shape)}, expected [T, D] with D = hidden = "
            f"{cfg.hidden}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"prefill_packed: x has dtype {x.dtype}, expected a floating dtype")
    if pooled:
        rows = np.shape(state.recurrent)[0] if np.ndim(state.recurrent) else 0
        if rows < 1:
            raise ValueError(
                f"prefill_packed: the state pool has shape {np.shape(state.recurrent)}, "
                "expected [N, H, K, V] with N >= 1 slots"
            )
        state.check(cfg, rows)
    else:
        state.check(cfg, n)


def packed_rows(t: int, n: int, cfg: KdaConfig) -> int:
    """Rows of the chunk-aligned stream that T tokens of N sequences are laid out in: a leading
    chunk, then per sequence its tokens and at least W-1 more rows, rounded up to chunks."""
    c, w = cfg.chunk, cfg.conv_kernel
    return c * -(-(c + t + n * (c + w - 2)) // c)


@functools.partial(jax.jit, static_argnames=_PACKED_STATIC)
def _prefill_packed(
    params, cfg, x, cu, state, slots, *, backend, interpret, precision, prefix_block
):
    n = cu.shape[0] - 1
    _check_packed_inputs(params, cfg, x, state, n, slots is not None)
    backend = backends.resolve(backend)
    _check_backend(backend, "prefill_packed")
    t = x.shape[0]
    m_rows = t // prefix_block if prefix_block else 0
    if n == 0 or t == 0:  # no token: every state as given
        out = jnp.zeros((t, cfg.hidden), params.dtype)
        if not prefix_block:
            return out, state
        return out, state, _empty_prefix(cfg, n, m_rows)

    def body(backend, diff, aux):
        return _packed_body(*diff, *aux, cfg, backend, interpret, precision, prefix_block)

    return _differentiable(body, backend, False, (params, x, state), (cu, slots))


def _packed_body(params, x, state, cu, slots, cfg, backend, interpret, precision, prefix_block):
    """`_prefill_packed` on one backend (interpret applies to pallas only)."""
    t = x.shape[0]
    m_rows = t // prefix_block if prefix_block else 0
    interpret = None if backend == "xla" else interpret
    codes = None if slots is None else _slot_codes(slots, state.recurrent.shape[0])
    conv_rows = state.conv if codes is None else ref.pool_rows(state.conv, codes)
    tok = _packed_tokens(x, cu, conv_rows, codes, prefix_block)
    lay = _packed_layout(tok, t, cfg)
    st = backends.stages(backend, interpret=interpret, precision=precision)
    c, w = cfg.chunk, cfg.conv_kernel
    # The stream of x rows (0 where no token is), through the input projections.
    x_s = jnp.where(lay.is_token[:, None], x[lay.src], 0)
    qkv, f_a, g_a, b = _in_proj(st, params, cfg, x_s)
    f = st.proj(f_a, params.f_b)  # the output gate's z is formed inside the core's norm
    # Each sequence's carried conv state goes in the W-1 rows before its first token, so the
    # conv restarts there by itself (a non-finite state is left out: its sequence is poisoned).
    state_at = lay.first[:, None] - (w - 1) + jnp.arange(w - 1)[None, :]  # [N, W-1]
    fill = jnp.where(tok.bad_conv[:, None, None], 0.0, conv_rows).astype(qkv.dtype)
    qkv = qkv.at[state_at.reshape(-1)].set(fill.reshape(-1, cfg.conv_dim))
    s_rows = qkv.shape[0]
    conv_out, _ = st.conv_prefill(
        qkv[None],
        jnp.zeros((1, w - 1, cfg.conv_dim), jnp.float32),
        params.conv_w,
        jnp.full((1,), s_rows, jnp.int32),
        qk_channels=cfg.qk_channels,
        head_dim=cfg.head_dim,
        l2_eps=cfg.l2_eps,
        splits=(cfg.qkv_dim,) * 3,
    )
    q, k, v = (_heads(cfg, a[0]) for a in conv_out)
    pb = prefix_block or c
    info = jnp.stack(
        [
            lay.first // c,
            lay.first // c + -(-tok.ok // c),
            tok.prefix_cu[:-1],
            tok.ok // pb if prefix_block else jnp.zeros_like(tok.ok),
        ],
        axis=1,
    )
    y, rec, prefix_rec = st.prefill_core_packed(
        q,
        k,
        v,
        f,
        b,
        g_a,
        params.g_b,
        state.recurrent,
        lay.is_token,
        info,
        params.a_log,
        params.dt_bias,
        params.o_norm_w,
        scale=cfg.scale,
        chunk=c,
        lower_bound=cfg.gate_lower_bound,
        eps=cfg.rms_norm_eps,
        g_bias=params.g_bias,
        out_dtype=params.dtype,
        slots=codes,
        nan_state=tok.poisoned,  # NaN final states written by the state pass itself
        prefix_block=prefix_block,
        prefix_rows=m_rows,
    )
    out_s = st.proj(y, params.o_proj)  # [S, D]
    at = jnp.where(tok.used, lay.first[tok.seq] + tok.rel, 0)
    out = jnp.where(tok.used[:, None], out_s[at], 0)
    out = jnp.where((tok.real & ~tok.used)[:, None], jnp.nan, out)
    # Each sequence's new conv state: the last W-1 rows of [its carried state | its tokens].
    back = tok.ok[:, None] - (w - 1) + jnp.arange(w - 1)[None, :]  # [N, W-1], from the start
    old = jnp.take_along_axis(conv_rows, jnp.clip(back + w - 1, 0, w - 2)[..., None], axis=1)
    new_conv = jnp.where(
        (back >= 0)[..., None], qkv[lay.first[:, None] + back].astype(jnp.float32), old
    )

    conv = jnp.where(tok.poisoned[:, None, None], jnp.nan, new_conv)  # [N, W-1, C]: small
    new_state = KdaState(
        recurrent=rec, conv=conv if codes is None else ref.pool_write(state.conv, codes, conv)
    )
    if not prefix_block:
        return out, new_state
    return out, new_state, _prefix_states(cfg, tok, lay, prefix_rec, qkv, prefix_block, m_rows)


class _PackedTokens(NamedTuple):
    """Per token of x [T] and per sequence [N]: where each token belongs and which ones run."""

    start: jax.Array  # [N] each sequence's first token in x
    seq: jax.Array  # [T] the sequence a token falls in (clipped to [0, N))
    rel: jax.Array  # [T] its position in that sequence
    real: jax.Array  # [T] a token of a sequence (not padding)
    used: jax.Array  # [T] a real token the block reads (before its sequence's first bad one)
    ok: jax.Array  # [N] tokens read per sequence
    poisoned: jax.Array  # [N] a real token (or the carried conv state) was non-finite
    bad_conv: jax.Array  # [N] the carried conv state holds a non-finite value
    prefix_cu: jax.Array  # [N + 1] offsets of each sequence's prefix states


def _packed_tokens(x, cu, conv_rows, codes, prefix_block=None) -> _PackedTokens:
    t = x.shape[0]
    n = cu.shape[0] - 1
    cu = lax.cummax(jnp.clip(cu, 0, t))  # concrete offsets were checked; traced ones made safe
    lengths = cu[1:] - cu[:-1]
    if codes is not None:  # a padding sequence has no real token
        lengths = jnp.where(codes == -1, 0, lengths)
    pos = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(cu[1:], pos, side="right"), 0, n - 1)
    rel = pos - cu[seq]
    real = (rel >= 0) & (rel < lengths[seq])
    bad = real & ~jnp.isfinite(x).all(-1)
    first_bad = jax.ops.segment_min(jnp.where(bad, rel, t), seq, num_segments=n)
    bad_conv = ~jnp.isfinite(conv_rows).all((1, 2))
    ok = jnp.minimum(lengths, jnp.where(bad_conv, 0, first_bad))
    if codes is not None:  # a refused sequence reads nothing and outputs NaN
        ok = jnp.where(codes < 0, 0, ok)
    used = real & (rel < ok[seq])
    counts = lengths // prefix_block if prefix_block else jnp.zeros_like(lengths)
    prefix_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)])
    return _PackedTokens(cu[:-1], seq, rel, real, used, ok, ok < lengths, bad_conv, prefix_cu)


class _PackedLayout(NamedTuple):
    """The chunk-aligned stream of `packed_rows(T, N)` rows: a leading chunk, then per sequence
    [its tokens | pad | the next sequence's W-1 conv state rows], a whole number of chunks of
    at least ok + W-1 rows. Every sequence's first token starts a chunk."""

    first: jax.Array  # [N] the stream row of each sequence's first token
    is_token: jax.Array  # [S] the row holds a token the block reads
    src: jax.Array  # [S] that token's index in x (0 where none)


def _packed_layout(tok: _PackedTokens, t: int, cfg: KdaConfig) -> _PackedLayout:
    c, w = cfg.chunk, cfg.conv_kernel
    ok = tok.ok
    n = ok.shape[0]
    s_rows = packed_rows(t, n, cfg)
    span = c * -(-(ok + w - 1) // c)  # >= C: room for the next sequence's conv state rows
    first = c + jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(span)[:-1]])
    row = jnp.arange(s_rows)
    owner = jnp.searchsorted(first, row, side="right") - 1  # -1 in the leading chunk
    o = jnp.clip(owner, 0, n - 1)
    rel = row - first[o]
    is_token = (owner >= 0) & (rel < ok[o])
    return _PackedLayout(first, is_token, jnp.where(is_token, tok.start[o] + rel, 0))


def _empty_prefix(cfg: KdaConfig, n: int, m_rows: int) -> PrefixStates:
    """No token: M zero rows (M = T // prefix_block), no sequence holding any."""
    return PrefixStates(states=KdaState.zeros(cfg, m_rows), cu=jnp.zeros((n + 1,), jnp.int32))


def _prefix_states(cfg, tok, lay, rec, qkv, block: int, m_rows: int) -> PrefixStates:
    """The prefix rows: the scan's recurrent states (written where a sequence read that many
    tokens) and the conv states gathered from the stream; NaN at or past a sequence's first
    non-finite token, zero past the last sequence's rows."""
    w = cfg.conv_kernel
    n = tok.ok.shape[0]
    if m_rows == 0:
        return _empty_prefix(cfg, n, 0)
    m = jnp.arange(m_rows)
    seq = jnp.clip(jnp.searchsorted(tok.prefix_cu[1:], m, side="right"), 0, n - 1)
    ends = (m - tok.prefix_cu[seq] + 1) * block  # tokens of the sequence before this state
    held = m < tok.prefix_cu[-1]
    read = held & (ends <= tok.ok[seq])
    at = lay.first[seq][:, None] + ends[:, None] - (w - 1) + jnp.arange(w - 1)[None, :]
    conv = qkv[jnp.where(read[:, None], at, 0)].astype(jnp.float32)  # [M, W-1, conv_dim]

    def select(a):
        r = lambda mask: mask.reshape((-1,) + (1,) * (a.ndim - 1))  # noqa: E731
        return jnp.where(r(read), a, jnp.where(r(held), jnp.nan, 0.0))

    return PrefixStates(states=KdaState(recurrent=select(rec), conv=select(conv)), cu=tok.prefix_cu)
