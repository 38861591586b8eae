"""The block's geometry and numeric constants (SPEC §7), frozen so `jax.jit` takes it as static.

`KdaConfig.validate()` states which code path needs which limit; `from_hf_config` reads a Hugging
Face `config.json`; `PRESETS` holds the Kimi-Linear-48B geometry and a tiny test geometry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

__all__ = ["DEFAULT_CHUNK", "KdaConfig", "PRESETS", "preset"]

# Shared memory per thread block on an H100/H200 (227 KB); the chunk kernels keep fp32 tiles there.
SMEM_CEILING_BYTES = 227 * 1024

# The prefill chunk width C when none is given. It changes the arithmetic order, not the result.
# 32 rather than 64 or 16: the fastest core on an H200 (docs/performance.md).
DEFAULT_CHUNK = 32


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """Geometry of one KDA block.

    Attributes:
      hidden: D, the model width the block reads and writes.
      heads: H.
      head_dim: K = V.
      conv_kernel: W, the short causal conv width (the current token included).
      gate_lower_bound: `lb` of the bounded gate (typically -5.0); None selects the unbounded
        gate `-exp(A_log) * softplus(f + dt_bias)`.
      rms_norm_eps: epsilon of the sigmoid-gated RMSNorm (`o_norm`).
      l2_eps: epsilon of the q/k L2 normalisation, applied as `1/sqrt(sum + eps)`.
      chunk: C, the prefill chunk width (DEFAULT_CHUNK, 32, unless given; 16, 32 or 64).
      max_verify: the largest k `decode_k` accepts (the batched GEMV's row limit).
    """

    hidden: int
    heads: int
    head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float | None = None
    rms_norm_eps: float = 1e-5
    l2_eps: float = 1e-6
    chunk: int = DEFAULT_CHUNK
    max_verify: int = 8

    def __post_init__(self):
        # Integer-like and float-like numpy scalars become Python numbers, so the config stays
        # hashable and prints plainly; then every limit is checked: an invalid config never exists.
        for name in ("hidden", "heads", "head_dim", "conv_kernel", "chunk", "max_verify"):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        for name in ("gate_lower_bound", "rms_norm_eps", "l2_eps"):
            value = getattr(self, name)
            if isinstance(value, np.floating | np.integer | int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        self.validate()

    # Derived sizes (SPEC notation).
    @property
    def qkv_dim(self) -> int:
        """P = H*K: width of each of q, k, v."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """3P: the q|k|v channels the depthwise conv sees."""
        return 3 * self.qkv_dim

    @property
    def qk_channels(self) -> int:
        """2P: the q|k channels, the only ones L2-normalised."""
        return 2 * self.qkv_dim

    @property
    def in_proj_dim(self) -> int:
        """Rows of the fused input projection: q | k | v | f_a | g_a | b."""
        return 3 * self.qkv_dim + 2 * self.head_dim + self.heads

    @property
    def scale(self) -> float:
        """s = K^-0.5, applied to q only."""
        return self.head_dim**-0.5

    @property
    def bounded_gate(self) -> bool:
        return self.gate_lower_bound is not None

    def recurrent_state_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.heads, self.head_dim, self.head_dim)

    def conv_state_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.conv_kernel - 1, self.conv_dim)

    def state_bytes(self, batch: int = 1) -> int:
        """Bytes of one state (fp32 recurrent + conv) for `batch` sequences."""
        shapes = (self.recurrent_state_shape(batch), self.conv_state_shape(batch))
        return 4 * sum(math.prod(s) for s in shapes)

    def weight_bytes(self, itemsize: int = 2) -> int:
        """Bytes of the block's matrices (what a decode step must read once)."""
        p, k, d = self.qkv_dim, self.head_dim, self.hidden
        return itemsize * (self.in_proj_dim * d + 2 * p * k + d * p)

    def validate(self) -> KdaConfig:
        """Checks every limit a code path relies on; returns self so calls can chain.

        Raises:
          ValueError: naming the field, the value found, the limit and the code path needing it.
        """
        errors = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        for name in ("hidden", "heads", "head_dim", "conv_kernel", "chunk", "max_verify"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r} must be a positive int",
            )
        if errors:
            raise ValueError("invalid KdaConfig: " + "; ".join(errors))
        need(
            _is_pow2(self.head_dim) and 16 <= self.head_dim <= 256,
            f"head_dim={self.head_dim} must be a power of two in [16, 256]: the recurrent and "
            "chunk kernels hold a [head_dim, head_dim] fp32 state tile, and Triton dots need "
            "power-of-two sizes >= 16",
        )
        need(
            2 <= self.conv_kernel <= 4,
            f"conv_kernel={self.conv_kernel} must be in [2, 4]: the conv kernels keep the sliding "
            "window of conv_kernel-1 past inputs in registers",
        )
        need(
            _is_pow2(self.chunk) and 16 <= self.chunk <= 64,
            f"chunk={self.chunk} must be a power of two in [16, 64]: chunk_prepare holds "
            "[chunk, chunk] fp32 tiles beside [chunk, head_dim] tiles in shared memory "
            f"({SMEM_CEILING_BYTES} bytes per block on an H200)",
        )
        need(
            self.hidden >= 16,
            f"hidden={self.hidden} must be >= 16: the GEMV kernels tile the reduction axis in "
            "power-of-two slices of at least 16",
        )
        need(
            1 <= self.max_verify <= 8,
            f"max_verify={self.max_verify} must be in [1, 8]: gemv_batchm sweeps the weights once "
            "for at most 8 rows",
        )
        if self.gate_lower_bound is not None:
            lb = self.gate_lower_bound
            need(
                isinstance(lb, float) and math.isfinite(lb) and lb < 0,
                f"gate_lower_bound={lb} must be a finite negative number (or None for the "
                "unbounded gate): the bounded gate is lb * sigmoid(...)",
            )
        for name in ("rms_norm_eps", "l2_eps"):
            value = getattr(self, name)
            need(
                isinstance(value, float) and value > 0 and math.isfinite(value),
                f"{name}={value!r} must be a positive finite float",
            )
        if errors:
            raise ValueError("invalid KdaConfig: " + "; ".join(errors))
        return self

    def replace(self, **changes: Any) -> KdaConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, source: dict | str | os.PathLike, **overrides: Any) -> KdaConfig:
        """Builds a config from a Hugging Face `config.json` (a dict, a file or its directory).

        Reads `hidden_size`, `rms_norm_eps` and `linear_attn_config` (`num_heads`, `head_dim`,
        `short_conv_kernel_size`, optional `gate_lower_bound`). A missing `gate_lower_bound`
        means the unbounded gate. `overrides` replace fields after reading (e.g. `chunk`).
        """
        if isinstance(source, dict):
            hf = source
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no Hugging Face config at {path!r}")
            with open(path) as f:
                hf = json.load(f)
        lac = hf.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ValueError(
                "config.json has no 'linear_attn_config' object: this is not a KDA checkpoint "
                f"(top-level keys: {sorted(hf)[:12]})"
            )
        missing = [k for k in ("num_heads", "head_dim") if k not in lac]
        missing += [k for k in ("hidden_size",) if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        lb = lac.get("gate_lower_bound")
        fields = dict(
            hidden=int(hf["hidden_size"]),
            heads=int(lac["num_heads"]),
            head_dim=int(lac["head_dim"]),
            conv_kernel=int(lac.get("short_conv_kernel_size", 4)),
            gate_lower_bound=None if lb is None else float(lb),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        )
        fields.update(overrides)
        return cls(**fields).validate()

    @staticmethod
    def kda_layers(hf: dict) -> list[int]:
        """0-based indices of the KDA layers named (1-based) by `linear_attn_config.kda_layers`."""
        return [int(i) - 1 for i in hf.get("linear_attn_config", {}).get("kda_layers", [])]


PRESETS: dict[str, KdaConfig] = {
    # Kimi-Linear-48B-A3B: hidden 2304, 32 heads x 128, conv 4, unbounded gate.
    "kimi-linear-48b": KdaConfig(hidden=2304, heads=32, head_dim=128, conv_kernel=4),
    # GLM-5.3-Flash / Kimi-K3 style bounded gate on the same geometry.
    "kimi-linear-48b-bounded": KdaConfig(
        hidden=2304, heads=32, head_dim=128, conv_kernel=4, gate_lower_bound=-5.0
    ),
    # Small enough for interpret-mode kernels on a CPU; odd hidden exercises tail tiles.
    "tiny": KdaConfig(hidden=96, heads=2, head_dim=32, conv_kernel=4, chunk=16),
    "tiny-bounded": KdaConfig(
        hidden=96, heads=2, head_dim=32, conv_kernel=4, chunk=16, gate_lower_bound=-5.0
    ),
}


def preset(name: str) -> KdaConfig:
    """Returns a validated preset config; unknown names raise with the list of known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].validate()
