"""Flax NNX module over the functional forward (`kda_jax.forward`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kda_jax import backends, forward
from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, init_params
from kda_jax.state import KdaState

__all__ = ["KimiDeltaAttention"]

_FIELDS = ("w_in", "f_b", "g_b", "conv_w", "a_log", "dt_bias", "o_norm_w", "o_proj")


class KimiDeltaAttention(nnx.Module):
    """One KDA block (SPEC §1) as a Flax NNX module.

    Each weight of `KdaParams` is an `nnx.Param` of the same name; `params()` returns them as a
    `KdaParams` for the functional core. The state is explicit: every method takes a `KdaState`
    and returns the new one (see `init_state`).

    As Flax layers do, the matrices are stored in `param_dtype` and the block computes in
    `dtype`: each call casts them at this boundary (`KdaParams.astype`, differentiable, so fp32
    parameters get fp32 gradients). The conv taps, A_log, dt_bias, the norm weight and the gate
    bias stay fp32 whatever the two say. For serving, store in the compute dtype
    (`param_dtype=dtype`) so no call pays for the cast.

    Args:
      cfg: the block's config (validated here, kept as `.cfg`).
      rngs: random streams for the weight init.
      backend: "xla", "pallas" or None (pallas on a GPU, xla elsewhere).
      dtype: compute dtype: of the matrices the kernels read, x and y (bf16 by default).
      param_dtype: storage dtype of the matrices (fp32 by default).
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
        param_dtype=jnp.float32,
        precision="default",
        gate_bias: bool = False,
    ):
        self.cfg = cfg.validate()
        self.backend = backends.resolve(backend)
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.precision = backends.to_precision(precision)
        p = init_params(cfg, rngs.params(), param_dtype)
        if gate_bias:
            p = p.replace(g_bias=jnp.zeros((cfg.qkv_dim,), jnp.float32))
        self._set(p)

    def _set(self, p: KdaParams) -> None:
        for name in _FIELDS:
            setattr(self, name, nnx.Param(getattr(p, name)))
        self.g_bias = None if p.g_bias is None else nnx.Param(p.g_bias)

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

    def _opts(self) -> dict:
        """The functional core's options for this block (the xla backend takes a precision)."""
        return dict(backend=self.backend, precision=self.precision)

    def init_state(self, batch: int) -> KdaState:
        return KdaState.zeros(self.cfg, batch)

    def prefill(
        self, x: jax.Array, state: KdaState, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """x [B, T, D], lengths [B] or None -> (y [B, T, D], new state). See forward.prefill."""
        return forward.prefill(
            self.params().astype(self.dtype), self.cfg, x, state, lengths, **self._opts()
        )

    def decode(self, x: jax.Array, state: KdaState) -> tuple[jax.Array, KdaState]:
        """x [B, D] -> (y [B, D], new state). See forward.decode."""
        return forward.decode(self.params().astype(self.dtype), self.cfg, x, state, **self._opts())

    def decode_k(self, x: jax.Array, state: KdaState) -> tuple[jax.Array, KdaState, KdaState]:
        """x [B, k, D] -> (y [B, k, D], state after row k-1, per-row snapshots)."""
        return forward.decode_k(
            self.params().astype(self.dtype), self.cfg, x, state, **self._opts()
        )

    def __call__(
        self, x: jax.Array, state: KdaState | None = None, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """Prefill from `state` (a fresh zero state when None)."""
        if state is None:
            state = self.init_state(x.shape[0])
        return self.prefill(x, state, lengths)
