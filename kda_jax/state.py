"""The state a KDA block carries between calls (SPEC §2)."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kda_jax.config import KdaConfig

__all__ = ["KdaState", "PrefixStates", "select_snapshot"]


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
        """A fresh state for `batch` sequences (0 gives an empty batch)."""
        batch = as_count(batch, "batch")
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


@struct.dataclass
class PrefixStates:
    """The states `prefill_packed(..., prefix_block=b)` saw at every b tokens of each sequence,
    for prefix caching, packed like the tokens: sequence i's j-th entry (the state after its
    first (j + 1) * b tokens, j < L_i // b) is row `cu[i] + j` of `states`.

    Attributes:
      states: KdaState whose leaves carry M = T // b rows ([M, H, K, V] and [M, W-1, conv_dim]):
        each row is a full state, so a sequence resumes from row m as from a state of one
        sequence (`jax.tree.map(lambda a: a[m:m + 1], states)`). Rows from cu[N] on are zero;
        rows at or past a sequence's first non-finite token are NaN, as its new state is.
      cu: [N + 1] int32, the offsets of each sequence's rows: cu[i + 1] - cu[i] = L_i // b
        (0 for a padding sequence, slot -1).
    """

    states: KdaState
    cu: jax.Array


def as_count(value, name: str) -> int:
    """`value` as a non-negative Python int; integer-like numpy scalars are accepted."""
    if isinstance(value, bool | float | np.floating):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def concrete(a) -> np.ndarray | None:
    """`a`'s values where they are known (outside jit), else None: what can be checked eagerly."""
    try:
        return np.asarray(a)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def select_snapshot(
    snapshots: KdaState, index: jax.Array, before: KdaState | None = None
) -> KdaState:
    """Picks, per sequence, the state after row `index[b]` of a `decode_k` call.

    A verify that accepts `a[b]` of its k tokens resumes from
    `select_snapshot(snaps, a - 1, before=state)`, where `state` is what `decode_k` was given:
    index -1 (no token accepted) selects that row of `before`.

    Args:
      snapshots: KdaState whose leaves are [B, k, ...] (`decode_k`'s third output).
      index: [B] integer array, each in [0, k), or in [-1, k) when `before` is given.
      before: the KdaState [B, ...] passed to `decode_k`; optional.
    Returns:
      KdaState [B, ...].
    Raises:
      TypeError / ValueError before any work when `index` is not an integer array of shape [B],
      or (for concrete values) when an index is out of range. Under `jit`, where values cannot be
      checked, a row with an out-of-range index gets an all-NaN state, never another row's.
    """
    bsz, k = snapshots.recurrent.shape[:2]
    index = jnp.asarray(index)
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise TypeError(f"select_snapshot: index has dtype {index.dtype}, expected integers")
    if index.shape != (bsz,):
        raise ValueError(f"select_snapshot: index has shape {index.shape}, expected ({bsz},)")
    lo = 0 if before is None else -1
    if before is not None:
        want = (bsz, *snapshots.recurrent.shape[2:]), (bsz, *snapshots.conv.shape[2:])
        got = tuple(before.recurrent.shape), tuple(before.conv.shape)
        if got != want:
            raise ValueError(f"select_snapshot: before has shapes {got}, expected {want}")
    vals = concrete(index)  # None under jit: checked by value below
    if vals is not None:
        out = (vals < lo) | (vals >= k)
        if out.any():
            hint = (
                "" if before is not None else " (pass before= to select the pre-call state at -1)"
            )
            raise ValueError(
                f"select_snapshot: index {vals.tolist()} has values {vals[out].tolist()} outside "
                f"[{lo}, {k}){hint}"
            )
    index = index.astype(jnp.int32)
    bad = (index < lo) | (index >= k)

    def take(snap, prev):
        idx = jnp.clip(index, 0, k - 1).reshape((-1,) + (1,) * (snap.ndim - 1))
        out = jnp.take_along_axis(snap, idx, axis=1)[:, 0]
        row = lambda m: m.reshape((-1,) + (1,) * (out.ndim - 1))  # noqa: E731
        if prev is not None:
            out = jnp.where(row(index == -1), prev, out)
        return jnp.where(row(bad), jnp.nan, out)

    prev = (None, None) if before is None else (before.recurrent, before.conv)
    return KdaState(
        recurrent=take(snapshots.recurrent, prev[0]), conv=take(snapshots.conv, prev[1])
    )
