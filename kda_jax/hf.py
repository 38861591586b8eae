"""Loading one KDA block from a Hugging Face checkpoint directory (SPEC §6).

A directory holds `config.json` and either `model.safetensors`, several `*.safetensors`, or a
sharded set with `model.safetensors.index.json`. Tensor names carry the prefix
`model.layers.{i}.self_attn.`; linears are torch `[out, in]`.

Every tensor the layer needs is checked (present, in one file only, a floating dtype, the right
shape) from the safetensors headers before any tensor is read; a problem raises
`CheckpointError` naming the file, the tensor, what was found and what was expected.
"""

from __future__ import annotations

import glob
import json
import operator
import os

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams

__all__ = [
    "CheckpointError",
    "PREFIX",
    "FLA_NAMES",
    "load_fla_layer",
    "load_fla_params",
    "load_hf_layer",
    "load_hf_params",
    "read_hf_config",
    "save_hf_checkpoint",
]

PREFIX = "model.layers.{i}.self_attn."
INDEX = "model.safetensors.index.json"
_FUSED_CONV_NAMES = ("qkv_conv1d.weight", "conv1d.weight")
# Safetensors dtypes a weight may have; everything is cast to the block's dtypes on load.
_FLOAT_DTYPES = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a KDA block; the message names the file and tensor."""


def _index(value, what: str) -> int:
    """`value` as a Python int (np.int64 and other integer scalars included; bool is not)."""
    if isinstance(value, bool):
        raise TypeError(f"{what}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}={value!r} must be an int") from None


def _shapes_text(shapes) -> str:
    return " or ".join(str(tuple(s)) for s in shapes)


class _Checkpoint:
    """Name -> file map over the safetensors files of a directory, from the headers only."""

    def __init__(self, path: str):
        self.path = path
        self._headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        index = os.path.join(path, INDEX)
        self.index = index if os.path.isdir(path) and os.path.isfile(index) else None
        if self.index:
            self.files = {
                name: os.path.join(path, fn) for name, fn in _read_index(self.index).items()
            }
            return
        if os.path.isfile(path):  # one safetensors file
            files = [path]
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files (and no {INDEX}) in {path!r}")
        self.files = {}
        for fn in files:
            for name in self._header(fn):
                if name in self.files:
                    raise CheckpointError(
                        f"tensor {name!r} is in two files, {self.files[name]!r} and {fn!r}, and "
                        f"no {INDEX} says which one holds it"
                    )
                self.files[name] = fn

    def _header(self, fn: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (safetensors dtype, shape) of every tensor in `fn`, read once."""
        if fn not in self._headers:
            try:
                with safe_open(fn, framework="numpy") as f:
                    self._headers[fn] = {
                        n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                        for n in f.keys()
                    }
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{fn!r} is not a readable safetensors file (truncated or not safetensors): {e}"
                ) from e
        return self._headers[fn]

    def names(self, prefix: str) -> list[str]:
        """Every tensor name starting with `prefix`, without it."""
        return sorted(n[len(prefix) :] for n in self.files if n.startswith(prefix))

    def meta(self, name: str) -> tuple[str, str, tuple[int, ...]]:
        """(file, dtype, shape) of a tensor the map holds."""
        fn = self.files[name]
        if self.index and not os.path.isfile(fn):
            raise CheckpointError(
                f"{self.index!r} maps tensor {name!r} to {os.path.basename(fn)!r}, which does not "
                f"exist in {self.path!r}"
            )
        header = self._header(fn)
        if name not in header:
            raise CheckpointError(
                f"{self.index!r} maps tensor {name!r} to {fn!r}, which holds no such tensor"
            )
        return fn, *header[name]

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """`tensor[index]` read from the file alone (safetensors `get_slice`), as numpy."""
        fn = self.files[name]
        try:
            with safe_open(fn, framework="numpy") as f:
                return np.asarray(f.get_slice(name)[index])
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{fn!r}: cannot read tensor {name!r}{list(index)}: {e}") from e

    def read(self, name: str) -> np.ndarray:
        """The tensor as numpy (bf16 arrives as ml_dtypes.bfloat16)."""
        fn = self.files[name]
        try:
            with safe_open(fn, framework="numpy") as f:
                return np.asarray(f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{fn!r}: cannot read tensor {name!r}: {e}") from e


def _read_index(index: str) -> dict[str, str]:
    """The weight_map of a `model.safetensors.index.json`, checked to map names to file names."""
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index!r} is not a readable JSON index: {e}") from e
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        if not isinstance(doc, dict):
            found = f"a JSON {type(doc).__name__}"
        elif "weight_map" not in doc:
            found = f"the keys {sorted(doc)[:8]}"
        else:
            found = f"a weight_map of type {type(wmap).__name__}"
        raise CheckpointError(
            f"{index!r} has no 'weight_map' object (tensor name -> file name); it holds {found}"
        )
    bad = [(n, fn) for n, fn in wmap.items() if not isinstance(fn, str) or not fn]
    if bad:
        raise CheckpointError(
            f"{index!r}: weight_map must map tensor names to file names; found {bad[0][0]!r}: "
            f"{bad[0][1]!r}"
        )
    return wmap


def read_hf_config(path: str | os.PathLike) -> tuple[KdaConfig, dict]:
    """The block's config and the raw `config.json` dict of the checkpoint directory `path`.

    Raises:
      FileNotFoundError: no such directory or no config.json in it.
      CheckpointError: config.json is not JSON or does not describe a valid KDA block.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist (no config.json)")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} is not a checkpoint directory: no config.json in it")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path!r} is not readable JSON: {e}") from e
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_path!r} holds a {type(hf).__name__}, expected an object")
    try:
        cfg = KdaConfig.from_hf_config(hf)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_path!r}: {e}") from e
    return cfg, hf


def _kda_layers(hf: dict, cfg_path: str) -> list[int] | None:
    """0-based KDA layers from `linear_attn_config.kda_layers` (1-based); None when not listed."""
    raw = hf.get("linear_attn_config", {}).get("kda_layers")
    if raw is None:
        return None
    ok = isinstance(raw, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in raw
    )
    if not ok:
        raise CheckpointError(
            f"{cfg_path!r}: linear_attn_config.kda_layers={raw!r}, expected a list of 1-based "
            "layer numbers"
        )
    return [i - 1 for i in raw]


def _layer_spec(cfg: KdaConfig, conv_names: list[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Short tensor name -> the shapes it may have (SPEC §6)."""
    p, kd, d, h, w = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads, cfg.conv_kernel
    spec: dict[str, tuple[tuple[int, ...], ...]] = {
        "q_proj.weight": ((p, d),),
        "k_proj.weight": ((p, d),),
        "v_proj.weight": ((p, d),),
        "f_a_proj.weight": ((kd, d),),
        "f_b_proj.weight": ((p, kd),),
        "g_a_proj.weight": ((kd, d),),
        "g_b_proj.weight": ((p, kd),),
        "b_proj.weight": ((h, d),),
        "A_log": ((h,), (1, 1, h, 1)),
        "dt_bias": ((p,), (h, kd)),
        "o_norm.weight": ((kd,),),
        "o_proj.weight": ((d, p),),
    }
    rows = 3 * p if len(conv_names) == 1 else p
    for n in conv_names:
        spec[n] = ((rows, 1, w), (rows, w))
    return spec


# The tensors only a KDA layer has (a full-attention layer also has q_proj and o_proj).
_KDA_ONLY = ("A_log", "dt_bias", "f_a_proj.weight", "b_proj.weight", "q_conv1d.weight")


def checked_layer(path: str | os.PathLike, layer_idx: int, cfg: KdaConfig | None = None):
    """Every check `load_hf_params` makes, from config.json and the safetensors headers only.

    Returns (cfg, checkpoint, tensor-name prefix, conv tensor names); raises as
    `load_hf_params` does. The sharded loader (`kda_jax.sharding.load_hf_sharded`) shares it.
    """
    path = os.fspath(path)
    layer_idx = _index(layer_idx, "layer_idx")
    hf_cfg, hf = read_hf_config(path)
    cfg = hf_cfg if cfg is None else cfg
    cfg.validate()
    cfg_path = os.path.join(path, "config.json")
    n_layers = hf.get("num_hidden_layers")
    n_layers = n_layers if isinstance(n_layers, int) and n_layers > 0 else None
    if layer_idx < 0 or (n_layers and layer_idx >= n_layers):
        raise ValueError(
            f"layer_idx={layer_idx} must be in [0, {n_layers if n_layers else 'num_layers'})"
            + (f" ({cfg_path!r} has num_hidden_layers={n_layers})" if n_layers else "")
        )
    kda_layers = _kda_layers(hf, cfg_path)
    if kda_layers is not None and layer_idx not in kda_layers:
        raise CheckpointError(
            f"layer {layer_idx} is not a KDA layer: {cfg_path!r} lists the KDA layers as "
            f"linear_attn_config.kda_layers (1-based) {[i + 1 for i in kda_layers]}, i.e. "
            f"layer_idx (0-based) in {kda_layers}"
        )

    ckpt = _Checkpoint(path)
    prefix = PREFIX.format(i=layer_idx)
    have = set(ckpt.names(prefix))
    if not have & set(_KDA_ONLY):
        listed = "" if kda_layers is not None else "; config.json lists no kda_layers"
        raise CheckpointError(
            f"layer {layer_idx} of {path!r} is not a KDA layer: it has none of the KDA tensors "
            f"{list(_KDA_ONLY)} (its tensors under {prefix!r}: {sorted(have)[:8] or 'none'})"
            + listed
        )
    fused = [n for n in _FUSED_CONV_NAMES if n in have]
    split = [f"{n}_conv1d.weight" for n in "qkv"]
    if fused and any(n in have for n in split):
        raise CheckpointError(
            f"layer {layer_idx} of {path!r} holds both a fused conv ({prefix}{fused[0]}) and split "
            "q/k/v_conv1d weights; expected one layout"
        )
    spec = _layer_spec(cfg, fused[:1] or split)
    missing = [n for n in spec if n not in have]
    if missing:
        where = f"the weight_map of {ckpt.index!r}" if ckpt.index else f"the checkpoint at {path!r}"
        conv = set(split) & set(missing)
        hint = f" (or one fused {prefix}{_FUSED_CONV_NAMES[0]} in their place)" if conv else ""
        raise CheckpointError(
            f"layer {layer_idx}: tensor(s) {[prefix + n for n in missing]} missing from {where}"
            + hint
        )
    _check_headers(ckpt, prefix, spec, cfg)
    return cfg, ckpt, prefix, fused[:1] or split


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
      layer_idx: which block (an int, numpy integers included); must be a KDA layer when
        config.json lists `kda_layers`.
      cfg: the block's config; default `read_hf_config(path)`.
      dtype: dtype of the matrices; conv, A_log, dt_bias and o_norm are always fp32.
    Returns:
      (cfg, params).
    Raises:
      FileNotFoundError: no directory, no config.json or no safetensors file.
      CheckpointError (a ValueError): naming the file and tensor, the value found and the one
        expected: a missing, misshaped, non-floating or duplicated tensor, a truncated or
        unreadable file, a bad index, a layer that is not a KDA layer.
    """
    cfg, ckpt, prefix, conv_names = checked_layer(path, layer_idx, cfg)
    t = {short: ckpt.read(prefix + short) for short in _layer_spec(cfg, conv_names)}
    names = dict(q="q_proj", k="k_proj", v="v_proj", f_a="f_a_proj", g_a="g_a_proj", b="b_proj")
    names.update(f_b="f_b_proj", g_b="g_b_proj")
    t = {k: t[f"{v}.weight"] for k, v in names.items()} | {
        "conv": [t[n] for n in conv_names],
        **{k: t[k] for k in ("A_log", "dt_bias", "o_norm.weight", "o_proj.weight")},
    }
    return cfg, _assemble(cfg, t, dtype)


def _check_headers(ckpt: _Checkpoint, prefix: str, spec: dict, cfg: KdaConfig) -> None:
    """Checks the dtype and shape of every tensor of `spec` (short name -> allowed shapes) from
    the headers."""
    for short, shapes in spec.items():
        name = prefix + short
        fn, dt, shape = ckpt.meta(name)
        if dt not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{fn!r}: tensor {name!r} has dtype {dt}, expected a floating dtype "
                f"({', '.join(_FLOAT_DTYPES)})"
            )
        if shape not in shapes:
            raise CheckpointError(
                f"{fn!r}: tensor {name!r} has shape {shape}, expected {_shapes_text(shapes)} "
                f"(hidden={cfg.hidden}, heads={cfg.heads}, head_dim={cfg.head_dim}, "
                f"conv_kernel={cfg.conv_kernel})"
            )


def _read_checked(ckpt: _Checkpoint, prefix: str, spec: dict, cfg: KdaConfig) -> dict:
    """`_check_headers`, then every tensor of `spec` read: short name -> numpy array."""
    _check_headers(ckpt, prefix, spec, cfg)
    return {short: ckpt.read(prefix + short) for short in spec}


def _assemble(cfg: KdaConfig, t: dict, dtype, g_bias=None) -> KdaParams:
    """KdaParams from checked tensors: the w_in parts q, k, v, f_a, g_a, b, then f_b, g_b,
    "conv" (a list of conv weights, q|k|v order), A_log, dt_bias, o_norm.weight, o_proj.weight."""
    h, p, w = cfg.heads, cfg.qkv_dim, cfg.conv_kernel
    conv_w = np.concatenate([a.reshape(-1, w).astype(np.float32) for a in t["conv"]])
    w_in = np.concatenate([t[n] for n in ("q", "k", "v", "f_a", "g_a", "b")], dtype=np.float32)
    mat = lambda a: jnp.asarray(np.asarray(a, np.float32)).astype(dtype)  # noqa: E731
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    params = KdaParams(
        w_in=mat(w_in),
        f_b=mat(t["f_b"]),
        g_b=mat(t["g_b"]),
        conv_w=f32(conv_w),
        a_log=f32(t["A_log"].reshape(h)),
        dt_bias=f32(t["dt_bias"].reshape(p)),
        o_norm_w=f32(t["o_norm.weight"]),
        o_proj=mat(t["o_proj.weight"]),
        g_bias=None if g_bias is None else f32(g_bias),
    )
    params.check(cfg)
    return params


# FLA's `fla.layers.kda.KimiDeltaAttention` state_dict (use_short_conv=True, conv_bias=False):
# FLA name -> the part of the block it holds (the same as the Hugging Face loader's names).
FLA_NAMES = {
    "q_proj.weight": "q",
    "k_proj.weight": "k",
    "v_proj.weight": "v",
    "f_proj.0.weight": "f_a",
    "f_proj.1.weight": "f_b",
    "g_proj.0.weight": "g_a",
    "g_proj.1.weight": "g_b",
    "b_proj.weight": "b",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "o_norm.weight": "o_norm.weight",
    "o_proj.weight": "o_proj.weight",
}
FLA_GATE_BIAS = "g_proj.1.bias"


def load_fla_params(
    path: str | os.PathLike, cfg: KdaConfig, *, prefix: str = "", dtype=jnp.bfloat16
) -> KdaParams:
    """Reads one `fla.layers.kda.KimiDeltaAttention` layer's weights (FLA's names) from
    safetensors: a file, or a directory of them (an index included).

    Args:
      path: a `.safetensors` file or a directory.
      cfg: the block's config (FLA's layer keeps none beside its weights: its hidden_size,
        num_heads, head_dim, conv_size, norm_eps, and lower_bound for the bounded gate).
      prefix: what precedes the layer's names, e.g. "model.layers.3.attn." in an FLA model.
      dtype: dtype of the matrices; conv, A_log, dt_bias, o_norm and the gate bias are fp32.
    The output gate's bias `g_proj.1.bias` is loaded when present (`KdaParams.g_bias`), else
    None. Any other tensor under `prefix` (a conv bias, a v expansion's extra weights) is an
    error: the block has no place for it, and ignoring it would compute another layer.
    Raises:
      FileNotFoundError: no such file or directory, or no safetensors file in it.
      CheckpointError: naming the file and tensor, the value found and the one expected.
    """
    cfg.validate()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no FLA checkpoint at {path!r}")
    ckpt = _Checkpoint(path)
    p, kd, d, h, w = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads, cfg.conv_kernel
    part = dict(q=(p, d), k=(p, d), v=(p, d), f_a=(kd, d), g_a=(kd, d), b=(h, d))
    part.update(f_b=(p, kd), g_b=(p, kd))
    part.update({"A_log": (h,), "dt_bias": (p,), "o_norm.weight": (kd,), "o_proj.weight": (d, p)})
    spec = {name: (part[role],) for name, role in FLA_NAMES.items()}
    spec.update({f"{n}_conv1d.weight": ((p, 1, w), (p, w)) for n in "qkv"})
    have = set(ckpt.names(prefix))
    if FLA_GATE_BIAS in have:
        spec[FLA_GATE_BIAS] = ((p,),)
    where = f"{path!r}" + (f" under prefix {prefix!r}" if prefix else "")
    missing = [prefix + n for n in spec if n not in have]
    if missing:
        raise CheckpointError(
            f"tensor(s) {missing} missing from the FLA checkpoint at {where} (expected the "
            f"names of fla.layers.kda.KimiDeltaAttention; tensors found: {sorted(have)[:8]})"
        )
    extra = sorted(have - set(spec))
    if extra:
        raise CheckpointError(
            f"unexpected tensor(s) {[prefix + n for n in extra]} in the FLA checkpoint at "
            f"{where}: the block holds {sorted(spec)} only (no conv bias, no value expansion); "
            "for a layer inside a model, pass its prefix"
        )
    t = _read_checked(ckpt, prefix, spec, cfg)
    parts = {role: t[name] for name, role in FLA_NAMES.items()}
    parts["conv"] = [t[f"{n}_conv1d.weight"] for n in "qkv"]
    return _assemble(cfg, parts, dtype, t.get(FLA_GATE_BIAS))


def load_fla_layer(
    path: str | os.PathLike,
    cfg: KdaConfig,
    *,
    prefix: str = "",
    backend: str | None = None,
    dtype=jnp.bfloat16,
):
    """A ready `KimiDeltaAttention` holding an FLA layer's weights (see `load_fla_params`)."""
    from kda_jax.module import KimiDeltaAttention

    params = load_fla_params(path, cfg, prefix=prefix, dtype=dtype)
    return KimiDeltaAttention.from_params(cfg, params, backend=backend)


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
    layer_idx = _index(layer_idx, "layer_idx")
    shards = _index(shards, "shards")
    if conv_layout not in ("split3d", "split2d", "fused"):
        raise ValueError(f"conv_layout={conv_layout!r}, expected split3d, split2d or fused")
    if a_log_shape not in ("kimi", "flat"):
        raise ValueError(f"a_log_shape={a_log_shape!r}, expected kimi or flat")
    if layer_idx < 0 or shards < 1:
        raise ValueError(f"{layer_idx=} must be >= 0 and {shards=} >= 1")
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
    else:
        for i, n in enumerate("qkv"):
            part = conv[i * p_ : (i + 1) * p_]
            t[f"{n}_conv1d.weight"] = part[:, None, :] if conv_layout == "split3d" else part
    tensors = {prefix + k: np.ascontiguousarray(v) for k, v in t.items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        wmap = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, os.path.join(path, fn))
            wmap.update({n: fn for n in part})
        with open(os.path.join(path, INDEX), "w") as f:
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
