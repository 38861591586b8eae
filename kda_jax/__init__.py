"""kda-jax: the Kimi Delta Attention block for JAX.

Functional core: `prefill`, `prefill_packed`, `decode`, `decode_k` over (`KdaParams`, `KdaConfig`,
`KdaState`);
Flax NNX module: `KimiDeltaAttention`; checkpoints: `load_hf_layer`; fp32 oracle:
`oracle_forward`; many devices: `kda_jax.sharding`.
"""

__version__ = "0.1.0"  # as pyproject.toml's [project] version

from kda_jax import sharding
from kda_jax.config import PRESETS, KdaConfig, preset
from kda_jax.forward import decode, decode_k, prefill, prefill_packed
from kda_jax.hf import (
    CheckpointError,
    load_fla_layer,
    load_fla_params,
    load_hf_layer,
    load_hf_params,
    save_hf_checkpoint,
)
from kda_jax.module import KimiDeltaAttention
from kda_jax.oracle import STAGES, oracle_forward
from kda_jax.params import NO_WEIGHT_DECAY, KdaParams, init_params, weight_decay_mask
from kda_jax.state import KdaState, PrefixStates, select_snapshot

__all__ = [
    "__version__",
    "KdaConfig",
    "PRESETS",
    "preset",
    "KdaParams",
    "init_params",
    "weight_decay_mask",
    "NO_WEIGHT_DECAY",
    "KdaState",
    "PrefixStates",
    "select_snapshot",
    "prefill",
    "prefill_packed",
    "decode",
    "decode_k",
    "KimiDeltaAttention",
    "CheckpointError",
    "load_hf_layer",
    "load_fla_params",
    "load_fla_layer",
    "load_hf_params",
    "save_hf_checkpoint",
    "oracle_forward",
    "STAGES",
    "sharding",
]
