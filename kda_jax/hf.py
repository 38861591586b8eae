"""Loading one KDA block from a Hugging Face checkpoint directory (SPEC §6).

A directory holds `config.json` and either `model.safetensors`, several `*.safetensors`, or a
sharded set with `model.safetensors.index.json`. Tensor names carry the prefix
`model.layers.{i}.self_attn.`; linears are torch `[out, in]`.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams

__all__ = ["load_hf_params", "load_hf_layer", "save_hf_checkpoint", "PREFIX"]

PREFIX = "model.layers.{i}.self_attn."
_FUSED_CONV_NAMES = ("qkv_conv1d.weight", "conv1d.weight")


class _Checkpoint:
    """Name -> file map over the safetensors files of a directory; reads tensors lazily."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            self.files = {name: os.path.join(path, fn) for name, fn in wmap.items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
            self.files = {}
            for fn in files:
                with safe_open(fn, framework="numpy") as f:
                    for name in f.keys():
                        self.files[name] = fn

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> np.ndarray:
        """The tensor as numpy (bf16 arrives as ml_dtypes.bfloat16)."""
        if name not in self.files:
            raise KeyError(name)
        with safe_open(self.files[name], framework="flax") as f:
            return np.asarray(f.get_tensor(name))


def _shape_error(name: str, expected: str, found) -> ValueError:
    return ValueError(f"tensor {name!r}: expected shape {expected}, found {tuple(found)}")


def load_hf_params(
    path: str | os.PathLike,
    layer_idx: int,
    cfg: KdaConfig | None = None,
    *,
    dtype=jnp.bfloat16,
) -> tuple[KdaConfig, KdaParams]:
    """Reads layer `layer_idx` (0-based, the `model.layers.{i}` index) into the fused layout.

    Args:
      path: checkpoint directory.
      layer_idx: which block; must be a KDA layer when config.json lists `kda_layers`.
      cfg: the block's config; default `KdaConfig.from_hf_config(path)`.
      dtype: dtype of the matrices; conv, A_log, dt_bias and o_norm are always fp32.
    Returns:
      (cfg, params).
    Raises:
      ValueError / KeyError naming the tensor, the expected and the found shape.
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not a checkpoint directory: no config.json in it")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if cfg is None:
        cfg = KdaConfig.from_hf_config(hf)
    cfg.validate()
    kda_layers = KdaConfig.kda_layers(hf)
    n_layers = hf.get("num_hidden_layers")
    if not isinstance(layer_idx, int) or layer_idx < 0 or (n_layers and layer_idx >= n_layers):
        raise ValueError(f"layer_idx={layer_idx!r} must be an int in [0, {n_layers})")
    if kda_layers and layer_idx not in kda_layers:
        raise ValueError(
            f"layer {layer_idx} is not a KDA layer; config.json lists (0-based) {kda_layers}"
        )
    ckpt = _Checkpoint(path)
    prefix = PREFIX.format(i=layer_idx)
    p, kd, d, h, w = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads, cfg.conv_kernel

    def get(short: str) -> np.ndarray:
        name = prefix + short
        if name not in ckpt:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint at {path!r}")
        return ckpt.get(name)

    def matrix(short: str, shape: tuple[int, int]) -> np.ndarray:
        t = get(short + ".weight")
        if t.shape != shape:
            raise _shape_error(prefix + short + ".weight", shape, t.shape)
        return t

    def conv(t: np.ndarray, name: str, rows: int) -> np.ndarray:
        if t.shape == (rows, 1, w):
            t = t[:, 0]
        if t.shape != (rows, w):
            raise _shape_error(name, f"({rows}, 1, {w}) or ({rows}, {w})", t.shape)
        return t.astype(np.float32)

    fused = [n for n in _FUSED_CONV_NAMES if prefix + n in ckpt]
    if fused:
        conv_w = conv(get(fused[0]), prefix + fused[0], 3 * p)
    else:
        conv_w = np.concatenate(
            [conv(get(f"{n}_conv1d.weight"), f"{prefix}{n}_conv1d.weight", p) for n in "qkv"]
        )
    a_log = get("A_log")
    if a_log.shape not in ((h,), (1, 1, h, 1)):
        raise _shape_error(prefix + "A_log", f"({h},) or (1, 1, {h}, 1)", a_log.shape)
    dt_bias = get("dt_bias")
    if dt_bias.shape not in ((p,), (h, kd)):
        raise _shape_error(prefix + "dt_bias", f"({p},) or ({h}, {kd})", dt_bias.shape)
    o_norm = get("o_norm.weight")
    if o_norm.shape != (kd,):
        raise _shape_error(prefix + "o_norm.weight", (kd,), o_norm.shape)
    w_in = np.concatenate(
        [
            matrix("q_proj", (p, d)),
            matrix("k_proj", (p, d)),
            matrix("v_proj", (p, d)),
            matrix("f_a_proj", (kd, d)),
            matrix("g_a_proj", (kd, d)),
            matrix("b_proj", (h, d)),
        ]
    )
    mat = lambda a: jnp.asarray(a).astype(dtype)  # noqa: E731
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    params = KdaParams(
        w_in=mat(w_in),
        f_b=mat(matrix("f_b_proj", (p, kd))),
        g_b=mat(matrix("g_b_proj", (p, kd))),
        conv_w=f32(conv_w),
        a_log=f32(a_log.reshape(h)),
        dt_bias=f32(dt_bias.reshape(p)),
        o_norm_w=f32(o_norm),
        o_proj=mat(matrix("o_proj", (d, p))),
    )
    params.check(cfg)
    return cfg, params


def load_hf_layer(
    path: str | os.PathLike,
    layer_idx: int,
    cfg: KdaConfig | None = None,
    *,
    backend: str | None = None,
    dtype=jnp.bfloat16,
):
    """A ready `KimiDeltaAttention` holding layer `layer_idx` of the checkpoint at `path`."""
    from kda_jax.module import KimiDeltaAttention

    cfg, params = load_hf_params(path, layer_idx, cfg, dtype=dtype)
    return KimiDeltaAttention.from_params(cfg, params, backend=backend)


def save_hf_checkpoint(
    path: str | os.PathLike,
    cfg: KdaConfig,
    params: KdaParams,
    layer_idx: int = 0,
    *,
    conv_layout: str = "split3d",
    a_log_shape: str = "kimi",
    shards: int = 1,
) -> None:
    """Writes one block as a Hugging Face checkpoint directory (config.json + safetensors).

    The inverse of `load_hf_params`; it also writes the layout variants of SPEC §6, so loading
    can be tested against every one of them.

    Args:
      conv_layout: "split3d" (q/k/v_conv1d [P, 1, W]), "split2d" ([P, W]) or "fused"
        (qkv_conv1d [3P, 1, W]).
      a_log_shape: "kimi" ([1, 1, H, 1]) or "flat" ([H]).
      shards: number of safetensors files; > 1 also writes model.safetensors.index.json.
    """
    from safetensors.numpy import save_file

    from kda_jax.params import in_proj_slices

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    p_, h, w = cfg.qkv_dim, cfg.heads, cfg.conv_kernel
    sl = in_proj_slices(cfg)
    prefix = PREFIX.format(i=layer_idx)
    np_ = lambda a: np.asarray(a)  # noqa: E731
    w_in = np_(params.w_in)
    t = {f"{n}_proj.weight": w_in[sl[n]] for n in ("q", "k", "v", "b")}
    t.update({"f_a_proj.weight": w_in[sl["f_a"]], "g_a_proj.weight": w_in[sl["g_a"]]})
    t.update({"f_b_proj.weight": np_(params.f_b), "g_b_proj.weight": np_(params.g_b)})
    t["o_proj.weight"] = np_(params.o_proj)
    t["o_norm.weight"] = np_(params.o_norm_w)
    t["dt_bias"] = np_(params.dt_bias)
    a_log = np_(params.a_log)
    t["A_log"] = a_log.reshape(1, 1, h, 1) if a_log_shape == "kimi" else a_log
    conv = np_(params.conv_w)
    if conv_layout == "fused":
        t["qkv_conv1d.weight"] = conv[:, None, :]
    elif conv_layout in ("split3d", "split2d"):
        for i, n in enumerate("qkv"):
            part = conv[i * p_ : (i + 1) * p_]
            t[f"{n}_conv1d.weight"] = part[:, None, :] if conv_layout == "split3d" else part
    else:
        raise ValueError(f"conv_layout={conv_layout!r}, expected split3d, split2d or fused")
    tensors = {prefix + k: np.ascontiguousarray(v) for k, v in t.items()}
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        wmap = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, os.path.join(path, fn))
            wmap.update({n: fn for n in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f, indent=1)
    lac = dict(
        num_heads=h, head_dim=cfg.head_dim, short_conv_kernel_size=w, kda_layers=[layer_idx + 1]
    )
    if cfg.gate_lower_bound is not None:
        lac["gate_lower_bound"] = cfg.gate_lower_bound
    hf = dict(
        model_type="kimi_linear",
        hidden_size=cfg.hidden,
        rms_norm_eps=cfg.rms_norm_eps,
        num_hidden_layers=layer_idx + 1,
        linear_attn_config=lac,
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
