"""Flax NNX module over the functional forward (`kda_jax.forward`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kda_jax import backends, forward
from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, init_params
from kda_jax.sharding import PARAM_AXES
from kda_jax.state import KdaState

__all__ = ["KimiDeltaAttention"]

_FIELDS = ("w_in", "f_b", "g_b", "conv_w", "a_log", "dt_bias", "o_norm_w", "o_proj")


def _param(name: str, value: jax.Array) -> nnx.Param:
    """An nnx.Param annotated with its partition axes over a ('data', 'model') mesh
    (`kda_jax.sharding.PARAM_AXES`), read by `nnx.get_partition_spec`; not placed eagerly, so
    a module is built the same with or without a mesh."""
    return nnx.Param(value, out_sharding=PARAM_AXES[name], eager_sharding=False)


class KimiDeltaAttention(nnx.Module):
    """One KDA block (SPEC §1) as a Flax NNX module.

    Each weight of `KdaParams` is an `nnx.Param` of the same name, annotated with its partition
    axes (`nnx.get_partition_spec`; heads over 'model', see `kda_jax.sharding`); `params()`
    returns them as a `KdaParams` for the functional core. The state is explicit: every method
    takes a `KdaState` and returns the new one (see `init_state`); with `slots`, a pool.

    As Flax layers do, the matrices are stored in `param_dtype` and the block computes in
    `dtype`: each call casts them at this boundary (`KdaParams.astype`, differentiable, so fp32
    parameters get fp32 gradients). The conv taps, A_log, dt_bias, the norm weight and the gate
    bias stay fp32 whatever the two say. `param_dtype` defaults to `dtype`, so no call pays for
    a cast unless asked (training: `param_dtype=jnp.float32` with bf16 compute).

    Args:
      cfg: the block's config (validated here, kept as `.cfg`).
      rngs: random streams for the weight init.
      backend: "xla", "pallas" or None (pallas on a GPU, xla elsewhere).
      dtype: compute dtype: of the matrices the kernels read, x and y (bf16 by default).
      param_dtype: storage dtype of the matrices (None: `dtype`).
      precision: the xla backend's projection dots ("default": the device's fastest, the same
        bits as "highest" on a CPU, TF32 on a GPU; "highest": IEEE fp32).
      gate_bias: give the output gate a bias (as FLA's layer has; zeros at init).
    """

    def __init__(
        self,
        cfg: KdaConfig,
        *,
        rngs: nnx.Rngs,
        backend: str | None = None,
        dtype=jnp.bfloat16,
        param_dtype=None,
        precision="default",
        gate_bias: bool = False,
    ):
        self.cfg = cfg.validate()
        self.backend = backends.resolve(backend)
        param_dtype = dtype if param_dtype is None else param_dtype
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.precision = backends.to_precision(precision)
        p = init_params(cfg, rngs.params(), param_dtype)
        if gate_bias:
            p = p.replace(g_bias=jnp.zeros((cfg.qkv_dim,), jnp.float32))
        self._set(p)

    def _set(self, p: KdaParams) -> None:
        for name in _FIELDS:
            setattr(self, name, _param(name, getattr(p, name)))
        self.g_bias = None if p.g_bias is None else _param("g_bias", p.g_bias)

    @classmethod
    def from_params(
        cls,
        cfg: KdaConfig,
        params: KdaParams,
        *,
        backend: str | None = None,
        dtype=None,
        precision="default",
    ) -> KimiDeltaAttention:
        """Wraps existing weights (e.g. loaded from a checkpoint) without a random init; they are
        stored as given (`param_dtype` = their dtype) and computed in `dtype` (default: theirs)."""
        params.check(cfg)
        dtype = params.dtype if dtype is None else dtype
        blk = nnx.eval_shape(
            lambda: cls(
                cfg,
                rngs=nnx.Rngs(0),
                backend=backend,
                dtype=dtype,
                param_dtype=params.dtype,
                precision=precision,
                gate_bias=params.g_bias is not None,
            )
        )
        blk._set(params)
        return blk

    def params(self) -> KdaParams:
        """The stored weights (matrices in `param_dtype`)."""
        fields = {name: getattr(self, name)[...] for name in _FIELDS}
        return KdaParams(**fields, g_bias=None if self.g_bias is None else self.g_bias[...])

    def _opts(self, slots) -> dict:
        """The functional core's options for this block (the xla backend takes a precision)."""
        return dict(slots=slots, backend=self.backend, precision=self.precision)

    def init_state(self, batch: int) -> KdaState:
        return KdaState.zeros(self.cfg, batch)

    def prefill(
        self,
        x: jax.Array,
        state: KdaState,
        lengths: jax.Array | None = None,
        *,
        slots: jax.Array | None = None,
    ) -> tuple[jax.Array, KdaState]:
        """x [B, T, D], lengths [B] or None -> (y [B, T, D], new state). With slots [B],
        `state` is a pool and row b works on slot slots[b]. See forward.prefill."""
        return forward.prefill(
            self.params().astype(self.dtype), self.cfg, x, state, lengths, **self._opts(slots)
        )

    def prefill_packed(
        self,
        x: jax.Array,
        cu_seqlens: jax.Array,
        state: KdaState,
        *,
        slots: jax.Array | None = None,
        prefix_block: int | None = None,
    ):
        """x [T, D] holding N sequences back to back at offsets cu_seqlens [N + 1] -> (y [T, D],
        new state), plus the `PrefixStates` with prefix_block. With slots [N], `state` is a pool
        and sequence i works on slot slots[i]. See forward.prefill_packed."""
        p = self.params().astype(self.dtype)
        return forward.prefill_packed(
            p, self.cfg, x, cu_seqlens, state, prefix_block=prefix_block, **self._opts(slots)
        )

    def decode(
        self, x: jax.Array, state: KdaState, *, slots: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """x [B, D] -> (y [B, D], new state), optionally from a pool at slots [B]. See
        forward.decode."""
        p = self.params().astype(self.dtype)
        return forward.decode(p, self.cfg, x, state, **self._opts(slots))

    def decode_k(
        self, x: jax.Array, state: KdaState, *, slots: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState, KdaState]:
        """x [B, k, D] -> (y [B, k, D], state after row k-1, per-row snapshots), optionally
        from a pool at slots [B]. See forward.decode_k."""
        p = self.params().astype(self.dtype)
        return forward.decode_k(p, self.cfg, x, state, **self._opts(slots))

    def __call__(
        self, x: jax.Array, state: KdaState | None = None, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """Prefill from `state` (a fresh zero state when None)."""
        if state is None:
            state = self.init_state(x.shape[0])
        return self.prefill(x, state, lengths)
