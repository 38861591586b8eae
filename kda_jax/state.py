"""The state a KDA block carries between calls (SPEC §2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kda_jax.config import KdaConfig

__all__ = ["KdaState", "select_snapshot"]


@struct.dataclass
class KdaState:
    """Per-sequence state of one block, both parts fp32.

    Attributes:
      recurrent: [B, H, K, V] fp32, the delta-rule state S of each head, K-major (row d of S
        belongs to key channel d, the axis the decay scales).
      conv: [B, W-1, conv_dim] fp32, the last W-1 raw (pre-conv) q|k|v projections, oldest
        first: `conv[:, -1]` is the previous token. Channels are q|k|v, head-major within each
        (channel `h*K + d`). A fresh sequence holds zeros.

    With a leading row axis (`[B, k, ...]`) the same class holds the per-row snapshots that
    `decode_k` returns.
    """

    recurrent: jax.Array
    conv: jax.Array

    @classmethod
    def zeros(cls, cfg: KdaConfig, batch: int) -> KdaState:
        """A fresh state for `batch` sequences."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r} must be a positive int")
        return cls(
            recurrent=jnp.zeros(cfg.recurrent_state_shape(batch), jnp.float32),
            conv=jnp.zeros(cfg.conv_state_shape(batch), jnp.float32),
        )

    def check(self, cfg: KdaConfig, batch: int) -> None:
        """Raises ValueError unless this is an fp32 state for `batch` sequences of `cfg`."""
        for name, arr, shape in (
            ("recurrent", self.recurrent, cfg.recurrent_state_shape(batch)),
            ("conv", self.conv, cfg.conv_state_shape(batch)),
        ):
            if tuple(arr.shape) != shape:
                raise ValueError(f"state.{name} has shape {tuple(arr.shape)}, expected {shape}")
            if arr.dtype != jnp.float32:
                raise ValueError(f"state.{name} has dtype {arr.dtype}, expected float32")


def select_snapshot(snapshots: KdaState, index: jax.Array) -> KdaState:
    """Picks, per sequence, the state after row `index[b]` of a `decode_k` call.

    A verify that accepts `a[b]` of its k tokens resumes from `select_snapshot(snaps, a - 1)`
    (a[b] >= 1; a row that accepts none keeps the state it had before the call).

    Args:
      snapshots: KdaState whose leaves are [B, k, ...].
      index: [B] int, row index in [0, k).
    """
    index = jnp.asarray(index, jnp.int32)

    def take(leaf):
        idx = index.reshape((-1,) + (1,) * (leaf.ndim - 1))
        return jnp.take_along_axis(leaf, idx, axis=1)[:, 0]

    return jax.tree.map(take, snapshots)
