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
    takes a `KdaState` and returns the new one (see `init_state`).

    Args:
      cfg: the block's config (validated here, kept as `.cfg`).
      rngs: random streams for the weight init.
      backend: "xla", "pallas" or None (pallas on a GPU, xla elsewhere).
      dtype: dtype of the matrices (bf16 by default; fp32 for exact checks).
    """

    def __init__(
        self,
        cfg: KdaConfig,
        *,
        rngs: nnx.Rngs,
        backend: str | None = None,
        dtype=jnp.bfloat16,
    ):
        self.cfg = cfg.validate()
        self.backend = backends.resolve(backend)
        p = init_params(cfg, rngs.params(), dtype)
        for name in _FIELDS:
            setattr(self, name, _param(name, getattr(p, name)))

    @classmethod
    def from_params(
        cls, cfg: KdaConfig, params: KdaParams, *, backend: str | None = None
    ) -> KimiDeltaAttention:
        """Wraps existing weights (e.g. loaded from a checkpoint) without a random init."""
        params.check(cfg)
        blk = nnx.eval_shape(
            lambda: cls(cfg, rngs=nnx.Rngs(0), backend=backend, dtype=params.dtype)
        )
        for name in _FIELDS:
            setattr(blk, name, _param(name, getattr(params, name)))
        return blk

    def params(self) -> KdaParams:
        return KdaParams(**{name: getattr(self, name)[...] for name in _FIELDS})

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
            self.params(), self.cfg, x, state, lengths, slots=slots, backend=self.backend
        )

    def decode(
        self, x: jax.Array, state: KdaState, *, slots: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """x [B, D] -> (y [B, D], new state), optionally from a pool at slots [B]. See
        forward.decode."""
        return forward.decode(self.params(), self.cfg, x, state, slots=slots, backend=self.backend)

    def decode_k(
        self, x: jax.Array, state: KdaState, *, slots: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState, KdaState]:
        """x [B, k, D] -> (y [B, k, D], state after row k-1, per-row snapshots), optionally
        from a pool at slots [B]. See forward.decode_k."""
        return forward.decode_k(
            self.params(), self.cfg, x, state, slots=slots, backend=self.backend
        )

    def __call__(
        self, x: jax.Array, state: KdaState | None = None, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, KdaState]:
        """Prefill from `state` (a fresh zero state when None)."""
        if state is None:
            state = self.init_state(x.shape[0])
        return self.prefill(x, state, lengths)
