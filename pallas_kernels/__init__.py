"""Pallas GPU kernels of the KDA block, each with a pure-jnp reference: Triton backend, and one
Mosaic GPU kernel (`gemv_mgpu.py`, Hopper only; `gemv.proj` picks it).

Kernels run compiled on an NVIDIA GPU and in interpret mode elsewhere (see `common.interpret`;
the Mosaic GPU kernel in Mosaic GPU's own interpreter).
Import kernels from their files (`from pallas_kernels.gemv import proj`; the package
namespace is left to the submodules, three of which share a kernel's name). Every public kernel
has the signature of its reference in `reference.py` (`<name>_reference`).

| stage (SPEC §1)                         | kernel                        | file             |
|-----------------------------------------|-------------------------------|------------------|
| projections (decode, verify)            | gemv, gemv_batchm, proj       | gemv.py          |
| w_in's projection on Hopper, 1-16 rows  | gemv_mgpu                     | gemv_mgpu.py     |
| short conv + SiLU + L2 of q, k          | conv_decode, conv_prefill     | conv.py          |
| decode conv with f_b, g_b in one launch | decode_front                  | front.py         |
| gate, beta                              | gate                          | gate.py          |
| recurrence (decode, verify, snapshots)  | recurrent, decode_core        | recurrent.py     |
| chunked prefill: intra-chunk            | chunk_prepare                 | chunk_prepare.py |
| chunked prefill: state pass and output  | chunk_scan                    | chunk_scan.py    |
| chunked prefill, orchestrated           | chunk_kda, prefill_core       | chunk.py         |
| sigmoid-gated RMSNorm                   | o_norm                        | o_norm.py        |
"""
