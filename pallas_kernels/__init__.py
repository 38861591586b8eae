"""Pallas (Triton backend) GPU kernels of the KDA block, each with a pure-jnp reference.

Kernels run compiled on an NVIDIA GPU and in interpret mode elsewhere (see `common.interpret`).
Every public kernel has the signature of its reference in `reference.py` (`<name>_reference`).

| stage (SPEC §1)                         | kernel                        | file             |
|-----------------------------------------|-------------------------------|------------------|
| projections (decode, verify)            | gemv, gemv_batchm, proj       | gemv.py          |
| short conv + SiLU + L2 of q, k          | conv_decode, conv_prefill     | conv.py          |
| gate, beta                              | gate                          | gate.py          |
| recurrence (decode, verify, snapshots)  | recurrent, decode_core        | recurrent.py     |
| chunked prefill: intra-chunk            | chunk_prepare                 | chunk_prepare.py |
| chunked prefill: state pass and output  | chunk_scan                    | chunk_scan.py    |
| chunked prefill, orchestrated           | chunk_kda, prefill_core       | chunk.py         |
| sigmoid-gated RMSNorm                   | o_norm                        | o_norm.py        |
"""

from pallas_kernels.chunk import chunk_kda, prefill_core
from pallas_kernels.chunk_prepare import chunk_prepare
from pallas_kernels.chunk_scan import chunk_scan
from pallas_kernels.conv import conv_decode, conv_prefill
from pallas_kernels.gate import gate
from pallas_kernels.gemv import gemv, gemv_batchm, proj
from pallas_kernels.o_norm import o_norm
from pallas_kernels.recurrent import decode_core, recurrent

__all__ = [
    "chunk_kda",
    "chunk_prepare",
    "chunk_scan",
    "conv_decode",
    "conv_prefill",
    "decode_core",
    "gate",
    "gemv",
    "gemv_batchm",
    "o_norm",
    "prefill_core",
    "proj",
    "recurrent",
]
