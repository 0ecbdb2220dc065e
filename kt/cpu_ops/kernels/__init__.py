"""The jitted micro-kernels, one file per ISA family (kt/cpu_ops/README.md has their contract):
``avx2``, ``avx512``, ``amx/`` (one file per scheme), with the vector types of ``_simd`` and the
ISA-agnostic jitted helpers ``actquant`` (activation quantisation) and ``scan`` (weight scans).

Importing this package imports none of them; ``kt.cpu_ops.registry`` names them.
"""
