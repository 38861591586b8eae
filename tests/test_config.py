"""KdaConfig: derived sizes, validation messages, HF config parsing, presets; KdaState."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import TOL

import kda_jax as K


def test_presets_and_derived_sizes():
    cfg = K.preset("kimi-linear-48b")
    assert (cfg.hidden, cfg.heads, cfg.head_dim, cfg.conv_kernel) == (2304, 32, 128, 4)
    assert cfg.gate_lower_bound is None and cfg.rms_norm_eps == 1e-5
    assert (cfg.qkv_dim, cfg.conv_dim, cfg.qk_channels) == (4096, 12288, 8192)
    assert cfg.in_proj_dim == 12288 + 256 + 32
    # SPEC §9: one block's weights are 78.9 MB in bf16, the state 2.1 MB per sequence.
    assert abs(cfg.weight_bytes() / 1e6 - 78.9) < TOL["spec_weight_mb"]
    assert abs(4 * 32 * 128 * 128 / 1e6 - 2.1) < TOL["spec_state_mb"]
    assert cfg.state_bytes() == 4 * (32 * 128 * 128 + 3 * 12288)
    hash(cfg)  # static jit argument
    with pytest.raises(AttributeError):
        cfg.hidden = 3  # frozen


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'nope'.*kimi-linear-48b"):
        K.preset("nope")


@pytest.mark.parametrize(
    "change,pattern",
    [
        (dict(head_dim=96), r"head_dim=96 .*power of two.*recurrent and chunk kernels"),
        (dict(conv_kernel=5), r"conv_kernel=5 .*registers"),
        (dict(chunk=128), r"chunk=128 .*chunk_prepare.*shared memory"),
        (dict(chunk=48), r"chunk=48"),
        (dict(max_verify=9), r"max_verify=9 .*gemv_batchm"),
        (dict(gate_lower_bound=2.0), r"gate_lower_bound=2.0"),
        (dict(heads=0), r"heads=0 must be a positive int"),
        (dict(l2_eps=0.0), r"l2_eps"),
    ],
)
def test_validate_names_limit_value_and_path(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        K.preset("tiny").replace(**change).validate()


def test_from_hf_config_both_gates(tmp_path):
    hf = dict(
        hidden_size=2304,
        rms_norm_eps=1e-5,
        linear_attn_config=dict(
            num_heads=32, head_dim=128, short_conv_kernel_size=4, kda_layers=[1, 2, 4]
        ),
    )
    cfg = K.KdaConfig.from_hf_config(hf)
    assert cfg == K.preset("kimi-linear-48b") and not cfg.bounded_gate
    assert K.KdaConfig.kda_layers(hf) == [0, 1, 3]
    hf["linear_attn_config"]["gate_lower_bound"] = -5
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf))
    assert K.KdaConfig.from_hf_config(tmp_path).gate_lower_bound == -5.0
    assert K.KdaConfig.from_hf_config(tmp_path / "config.json", chunk=32).chunk == 32
    with pytest.raises(FileNotFoundError):
        K.KdaConfig.from_hf_config(tmp_path / "missing")
    with pytest.raises(ValueError, match="lacks required keys"):
        K.KdaConfig.from_hf_config({"linear_attn_config": {"num_heads": 2}})


def test_state_zeros_layout_and_checks():
    cfg = K.preset("tiny")
    s = K.KdaState.zeros(cfg, 3)
    assert s.recurrent.shape == (3, 2, 32, 32) and s.recurrent.dtype == jnp.float32
    assert s.conv.shape == (3, 3, 192) and s.conv.dtype == jnp.float32
    assert len(jax.tree.leaves(s)) == 2  # a pytree
    with pytest.raises(ValueError, match="batch=-1 must be >= 0"):
        K.KdaState.zeros(cfg, -1)
    with pytest.raises(ValueError, match=r"state.recurrent has shape \(3, 2, 32, 32\), expected"):
        s.check(cfg, 2)
    bad = s.replace(conv=s.conv.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="state.conv has dtype bfloat16, expected float32"):
        bad.check(cfg, 3)


@pytest.mark.slow
def test_init_params_realistic_scales():
    """Per-token decay spread over roughly [0.5, 0.999]; unit-scale projections."""
    for name in ("kimi-linear-48b", "kimi-linear-48b-bounded"):
        cfg = K.preset(name)
        p = K.init_params(cfg, jax.random.key(0))
        from pallas_kernels.reference import gate_reference

        f = jnp.zeros((cfg.qkv_dim,))  # gate at f = 0: the per-channel decay dt_bias sets
        g, _ = gate_reference(
            f,
            jnp.zeros(cfg.heads),
            p.a_log,
            p.dt_bias,
            head_dim=cfg.head_dim,
            lower_bound=cfg.gate_lower_bound,
        )
        decay = jnp.exp(g)
        (lo, hi), (lo2, hi2) = TOL["init_decay_min"], TOL["init_decay_max"]
        assert lo < float(decay.min()) < hi and lo2 < float(decay.max()) < hi2, name
        x = jax.random.normal(jax.random.key(1), (16, cfg.hidden), jnp.bfloat16)
        y = (x @ p.w_in.T).astype(jnp.float32)
        lo, hi = TOL["init_proj_std"]
        assert lo < float(jnp.std(y)) < hi
