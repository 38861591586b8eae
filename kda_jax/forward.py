"""The block's forward (SPEC §1, §3): `prefill`, `decode`, `decode_k`, written once.

Each entry point checks its arguments (SPEC §10), then runs a jitted pure function of (params,
cfg, inputs, state) with `cfg`, `backend`, `interpret` and `return_stages` static. The backend is
resolved in `kda_jax.backends` and supplies the stage functions; nothing here depends on which
one runs.
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
from pallas_kernels.gemv import MAX_TILE_ROWS

__all__ = ["prefill", "decode", "decode_k"]

_STATIC = ("cfg", "backend", "interpret", "return_stages", "precision")


def _check_cfg(cfg, what: str) -> None:
    """Before jit sees cfg as a static argument: it must be a (valid, hashable) KdaConfig."""
    if not isinstance(cfg, KdaConfig):
        raise TypeError(f"{what}: cfg is a {type(cfg).__name__}, expected a KdaConfig")
    cfg.validate()


def _check_inputs(params, cfg: KdaConfig, x, state: KdaState, rank: int, what: str) -> None:
    """Every check an entry point makes before any work: params, x, state."""
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
    state.check(cfg, x.shape[0])


def _check_backend(backend: str, what: str, rows: int | None = None) -> None:
    """The pallas backend's envelope, checked before tracing any kernel."""
    if backend != "pallas":
        return
    if jax.config.jax_enable_x64:
        raise NotImplementedError(
            f"{what}: the pallas backend does not run with jax_enable_x64 on (its kernels index "
            "in int32); use backend='xla' or turn x64 off"
        )
    if rows is not None and rows > MAX_TILE_ROWS:  # the projections' largest row tile
        raise ValueError(
            f"{what}: {rows} rows (B * k) exceed the pallas backend's decode limit of "
            f"{MAX_TILE_ROWS}; use backend='xla' for larger batches"
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


def _rows(params, cfg, x, state, backend, interpret, snapshots, return_stages, precision=None):
    """R rows per sequence through the decode path; shared by `decode` and `decode_k`."""
    backend = backends.resolve(backend)
    b_, r, d = x.shape
    _check_backend(backend, "decode_k" if snapshots else "decode", b_ * r)
    if b_ == 0:
        return _empty_rows(params, cfg, x, state, snapshots, return_stages)
    if backend == "pallas":
        params, x, state = _refuse_grad((params, x, state))
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
        biases=(None, params.g_bias),
        qk_channels=cfg.qk_channels,
        head_dim=cfg.head_dim,
        l2_eps=cfg.l2_eps,
        splits=(cfg.qkv_dim,) * 3,  # q, k, v written apart by the kernel: no slice copies
        snapshots=snapshots,
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
    )
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
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """One token per sequence.

    Args:
      params: the block's weights; cfg: its config (static).
      x: [B, D] input-layernorm output of the new token.
      state: KdaState for B sequences.
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
    return _decode(
        params,
        cfg,
        x,
        state,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(params, cfg, x, state, *, backend, interpret, return_stages, precision):
    _check_inputs(params, cfg, x, state, 2, "decode")
    y, new_state, _, stages = _rows(
        params, cfg, x[:, None], state, backend, interpret, False, return_stages, precision
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
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """Speculative verify: k tokens per sequence, projections in one weight sweep.

    Args:
      x: [B, k, D] with 1 <= k <= cfg.max_verify.
    Returns:
      y [B, k, D]; the state after the last row; snapshots, a KdaState whose leaves carry a row
      axis ([B, k, H, K, V] and [B, k, W-1, conv_dim]): the state after each row. A caller that
      accepts a of the k tokens resumes from `select_snapshot(snapshots, a - 1)`.
    On the pallas backend, compiled, the results equal k serial `decode` calls bit for bit when
    B * k <= 8 (`pallas_kernels.gemv.MAX_KERNEL_ROWS`: the projections' rows share one tiling);
    with more rows, and in interpret mode (XLA's CPU compiler contracts multiply-adds per call
    site), they agree within fp32 rounding.
    """
    _check_cfg(cfg, "decode_k")
    return _decode_k(
        params,
        cfg,
        x,
        state,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_k(params, cfg, x, state, *, backend, interpret, return_stages, precision):
    _check_inputs(params, cfg, x, state, 3, "decode_k")
    k = x.shape[1]
    if not 1 <= k <= cfg.max_verify:
        raise ValueError(f"decode_k: k={k} rows, expected 1 <= k <= max_verify={cfg.max_verify}")
    y, new_state, snaps, stages = _rows(
        params, cfg, x, state, backend, interpret, True, return_stages, precision
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
    backend: str | None = None,
    interpret: bool | None = None,
    return_stages: bool = False,
    precision=None,
):
    """Chunked prefill of T padded tokens per sequence from the carried state.

    Args:
      x: [B, T, D]; T is static (one compilation per padded T).
      state: KdaState for B sequences.
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
    return _prefill(
        params,
        cfg,
        x,
        state,
        lengths,
        backend=backend,
        interpret=interpret,
        return_stages=return_stages,
        precision=precision,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(params, cfg, x, state, lengths, *, backend, interpret, return_stages, precision):
    _check_inputs(params, cfg, x, state, 3, "prefill")
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
    # The block reads only the real tokens before a row's first non-finite one (`ok`): the
    # chunked products would otherwise carry a NaN back to earlier rows of its chunk (0 * NaN).
    pos = jnp.arange(t)[None, :]
    real = pos < lengths[:, None]
    first_bad = jnp.min(jnp.where(real & ~jnp.isfinite(x).all(-1), pos, t), axis=1)
    ok = jnp.minimum(lengths, first_bad)
    if backend == "xla":
        # Gradients flow through this backend: zero the rows the block ignores, or the
        # projections' backward would multiply their zero cotangents by NaN (dW = x^T dy).
        x = jnp.where((pos < ok[:, None])[..., None], x, 0)
    out, new_state, stages = _prefill_rows(
        params, cfg, x, state, ok, backend, interpret, return_stages, precision
    )
    # After o_proj, not before: its backward multiplies its input by the (zero) cotangents.
    out = jnp.where((real & (pos >= ok[:, None]))[..., None], jnp.nan, out)
    poisoned = ok < lengths
    new_state = jax.tree.map(
        lambda a: jnp.where(poisoned.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.nan, a), new_state
    )
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


def _prefill_rows(params, cfg, x, state, ok, backend, interpret, return_stages, precision=None):
    """The block over x [B, T, D] whose tokens below `ok` are real (and finite); the others
    touch nothing and output 0."""
    b_, t, _ = x.shape
    st = backends.stages(backend, interpret=interpret, precision=precision)
    qkv, f_a, g_a, b = _in_proj(st, params, cfg, x.reshape(b_ * t, -1))
    f, z = st.proj_many((f_a, g_a), (params.f_b, params.g_b), biases=(None, params.g_bias))
    shape = lambda a: a.reshape(b_, t, a.shape[-1])  # noqa: E731
    qkv, f, b, z = shape(qkv), shape(f), shape(b), shape(z)
    conv_out, conv_state = st.conv_prefill(
        qkv,
        state.conv,
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
        z,
        state.recurrent,
        ok,
        params.a_log,
        params.dt_bias,
        params.o_norm_w,
        scale=cfg.scale,
        chunk=cfg.chunk,
        lower_bound=cfg.gate_lower_bound,
        eps=cfg.rms_norm_eps,
        out_dtype=params.dtype,
    )
    out = st.proj(y.reshape(b_ * t, cfg.qkv_dim), params.o_proj).reshape(b_, t, cfg.hidden)
    new_state = KdaState(recurrent=rec, conv=conv_state)
    stages = None
    if return_stages:
        stages = dict(qkv_proj=qkv, q=q, k=k, v=v, g_raw=f, out_gate=z, o_norm_out=y, final_out=out)
    return out, new_state, stages
