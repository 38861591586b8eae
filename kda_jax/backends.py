"""The one place a backend name becomes the functions the block's forward calls.

Both backends expose the same stages with the signatures of `pallas_kernels.reference`:
`proj`, `proj_many`, `decode_front` (the decode conv with the f_b | g_b projections),
`conv_prefill`, `decode_core`, `prefill_core`, and `prefill_core_packed` (packed sequences in one
stream).
- `xla`: the pure-jnp references (any platform; the CPU default).
- `pallas`: the Pallas Triton kernels (the GPU default); on a machine without a GPU they run in
  interpret mode, which is slow and meant for tests. Its gradients are those of `xla_vjp`
  (internal): the xla references around the chunked core, which runs on the Pallas kernels of
  `chunk_vjp` (forward and backward). `stages("pallas", interpret=False)` gives the compiled
  kernels on any machine (cross-lowering for a GPU), `interpret=True` the interpreted ones on
  a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax import lax

from pallas_kernels import reference as ref

__all__ = ["BACKENDS", "Stages", "default_backend", "stages"]

BACKENDS = ("xla", "pallas")
# Internal: what the pallas backend differentiates, the xla references around the chunked core
# on the Pallas kernels of `chunk_vjp.chunk_kda_vjp`.
VJP_BACKEND = "xla_vjp"


@dataclasses.dataclass(frozen=True)
class Stages:
    proj: Callable
    proj_many: Callable
    decode_front: Callable
    conv_prefill: Callable
    decode_core: Callable
    prefill_core: Callable
    prefill_core_packed: Callable


def default_backend() -> str:
    """`pallas` when JAX's default device is a GPU, else `xla`."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve(backend: str | None) -> str:
    """Validates a backend name (None picks the platform default)."""
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    return backend


def to_precision(value) -> lax.Precision | None:
    """A dot precision by name ("highest", "default", ...) or `lax.Precision`; None stays None
    (the references' HIGHEST)."""
    if value is None or isinstance(value, lax.Precision):
        return value
    try:
        return lax.Precision(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"precision={value!r}: expected None, a jax.lax.Precision or one of "
            "'highest', 'high', 'default'"
        ) from None


def vjp_core(interpret: bool | None = None) -> Callable:
    """The chunked core on VJP_BACKEND: `chunk_vjp.chunk_kda_vjp`, with
    `reference.chunk_kda_reference`'s signature."""
    from pallas_kernels.chunk_vjp import chunk_kda_vjp

    return functools.partial(chunk_kda_vjp, interpret=interpret)


def stages(backend: str, *, interpret: bool | None = None, precision=None) -> Stages:
    """The stage functions of a (resolved) backend.

    interpret: the pallas kernels' mode, passed to every stage (None: interpret mode when there
    is no GPU); the xla backend has no kernels and takes None only.
    precision: the xla backend's projection dots, the output gate's inside `prefill_core` too
    (None: HIGHEST); the pallas kernels fix their own (IEEE fp32 for fp32 weights, fp32
    accumulation for bf16) and ignore it.
    """
    prec = to_precision(precision)
    if backend in ("xla", VJP_BACKEND):
        core = None
        if backend == VJP_BACKEND:
            core = vjp_core(interpret)
        elif interpret is not None:
            raise ValueError(f"interpret={interpret} applies to the pallas backend, not xla")
        bind = functools.partial(functools.partial, precision=prec)
        return Stages(
            proj=bind(ref.gemv_reference),
            proj_many=bind(ref.proj_many_reference),
            decode_front=bind(ref.decode_front_reference),
            conv_prefill=ref.conv_prefill_reference,
            decode_core=ref.decode_core_reference,
            prefill_core=functools.partial(ref.prefill_core_reference, precision=prec, core=core),
            prefill_core_packed=bind(ref.prefill_core_packed_reference),
        )
    if backend == "pallas":
        from pallas_kernels.chunk import prefill_core, prefill_core_packed
        from pallas_kernels.conv import conv_prefill
        from pallas_kernels.front import decode_front
        from pallas_kernels.gemv import proj, proj_many
        from pallas_kernels.recurrent import decode_core

        def bind(fn):
            return functools.partial(fn, interpret=interpret)

        return Stages(
            proj=bind(proj),
            proj_many=bind(proj_many),
            decode_front=bind(decode_front),
            conv_prefill=bind(conv_prefill),
            decode_core=bind(decode_core),
            prefill_core=bind(prefill_core),
            prefill_core_packed=bind(prefill_core_packed),
        )
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
