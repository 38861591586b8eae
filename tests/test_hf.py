"""Checkpoint loading (SPEC §6) from generated safetensors in every shape variant."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kda_jax as K
from kda_jax.config import DEFAULT_CHUNK
from kda_jax.hf import PREFIX, load_hf_params, save_hf_checkpoint


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "conv_layout,a_log_shape,shards",
    [("split3d", "kimi", 1), ("split2d", "flat", 1), ("fused", "kimi", 3), ("split3d", "flat", 2)],
)
@pytest.mark.parametrize("name", ["tiny", "tiny-bounded"])
def test_roundtrip_every_variant(tmp_path, name, conv_layout, a_log_shape, shards, dtype):
    cfg = K.preset(name)
    params = K.init_params(cfg, jax.random.key(3), dtype)
    save_hf_checkpoint(
        tmp_path,
        cfg,
        params,
        layer_idx=2,
        conv_layout=conv_layout,
        a_log_shape=a_log_shape,
        shards=shards,
    )
    got_cfg, got = load_hf_params(tmp_path, 2, dtype=dtype)
    assert got_cfg == cfg.replace(chunk=DEFAULT_CHUNK)  # not a checkpoint key: the default
    chex.assert_trees_all_equal(got, params)
    for leaf in ("conv_w", "a_log", "dt_bias", "o_norm_w"):
        assert getattr(got, leaf).dtype == jnp.float32


def test_load_hf_layer_runs_and_matches(tmp_path):
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(4), jnp.float32)
    save_hf_checkpoint(tmp_path, cfg, params, layer_idx=0)
    blk = K.load_hf_layer(tmp_path, 0, cfg, dtype=jnp.float32, backend="xla")
    assert blk.cfg == cfg
    x = jax.random.normal(jax.random.key(5), (1, 7, cfg.hidden))
    y, _ = blk(x)
    y_ref, _ = K.prefill(params, cfg, x, K.KdaState.zeros(cfg, 1), backend="xla")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_bf16_file_is_stored_in_fp32_where_spec_says(tmp_path):
    """A checkpoint holding conv/A_log/dt_bias in bf16 still loads them as fp32."""
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(6), jnp.bfloat16)
    save_hf_checkpoint(tmp_path, cfg, params)
    fn = os.path.join(tmp_path, "model.safetensors")
    t = load_file(fn)
    pre = PREFIX.format(i=0)
    for n in ("A_log", "dt_bias", "q_conv1d.weight"):
        t[pre + n] = np.asarray(jnp.asarray(t[pre + n]).astype(jnp.bfloat16))
    save_file(t, fn)
    _, got = load_hf_params(tmp_path, 0)
    assert got.a_log.dtype == got.dt_bias.dtype == got.conv_w.dtype == jnp.float32


def test_missing_gate_lower_bound_means_unbounded(tmp_path):
    cfg = K.preset("tiny-bounded")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)))
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert K.KdaConfig.from_hf_config(hf).gate_lower_bound == -5.0
    del hf["linear_attn_config"]["gate_lower_bound"]
    assert K.KdaConfig.from_hf_config(hf).gate_lower_bound is None


def test_missing_tensor_is_named(tmp_path):
    cfg = K.preset("tiny")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)))
    fn = os.path.join(tmp_path, "model.safetensors")
    t = load_file(fn)
    del t[PREFIX.format(i=0) + "g_b_proj.weight"]
    save_file(t, fn)
    with pytest.raises(KeyError, match="g_b_proj.weight"):
        load_hf_params(tmp_path, 0)


@pytest.mark.parametrize(
    "tensor,bad_shape",
    [
        ("k_proj.weight", (64, 95)),
        ("A_log", (3,)),
        ("v_conv1d.weight", (64, 1, 3)),
        ("o_norm.weight", (31,)),
    ],
)
def test_misshaped_tensor_names_expected_and_found(tmp_path, tensor, bad_shape):
    cfg = K.preset("tiny")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0), jnp.float32))
    fn = os.path.join(tmp_path, "model.safetensors")
    t = load_file(fn)
    t[PREFIX.format(i=0) + tensor] = np.ones(bad_shape, np.float32)
    save_file(t, fn)
    with pytest.raises(ValueError, match=tensor) as e:
        load_hf_params(tmp_path, 0)
    assert str(bad_shape) in str(e.value) and "expected" in str(e.value)


def test_not_a_kda_layer_and_bad_dirs(tmp_path):
    cfg = K.preset("tiny")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)), layer_idx=1)
    with pytest.raises(ValueError, match="not a KDA layer"):
        load_hf_params(tmp_path, 0)
    with pytest.raises(ValueError, match="layer_idx"):
        load_hf_params(tmp_path, 5)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_params(tmp_path / "nowhere", 0)
    with pytest.raises(ValueError, match="linear_attn_config"):
        K.KdaConfig.from_hf_config({"hidden_size": 8})
