"""Built-in kernel registrations: (op, scheme, variant) -> "module:attribute".

Ops (the contract each kernel module implements is in kt/cpu_ops/README.md):
  gemv  small-M GEMM (decode), gemm  large-M tiled GEMM (prefill).
"""
from ..config import QuantScheme as S
from .registry import register

_M = "kt.cpu_ops"

# Filled in as kernel families land.

# AMX tiles (kernels_amx.py; importing it raises unless isa found AMX runnable).
register("gemv", S.INT8, "amx", f"{_M}.kernels_amx:gemv_int8")
register("gemm", S.INT8, "amx", f"{_M}.kernels_amx:gemm_int8")
register("gemv", S.INT4, "amx", f"{_M}.kernels_amx:gemv_int4")
register("gemm", S.INT4, "amx", f"{_M}.kernels_amx:gemm_int4")
register("gemv", S.BF16, "amx", f"{_M}.kernels_amx:gemv_bf16")
register("gemm", S.BF16, "amx", f"{_M}.kernels_amx:gemm_bf16")

# AVX-512 (kernels_avx512.py): INT8 / INT4 need VNNI (vpdpbusd), BF16 needs AVX512_BF16.
# Decode: on the AMX Xeon (14 threads, qwen3-30b-a3b layer, benchmarks/results/
# decode_variants_device.json) the VNNI gemv beat the AMX gemv: INT8 T=1 0.35 vs 0.43 ms, INT4 T=1
# 0.21 vs 0.32 ms (BF16: AMX 0.79 vs 0.86 ms), so it is preferred where both run.
register("gemv", S.INT8, "avx512_vnni", f"{_M}.kernels_avx512:gemv_int8", priority=1)
register("gemm", S.INT8, "avx512_vnni", f"{_M}.kernels_avx512:gemm_int8")
# The INT4 gemv prefetches every packed line 4 KB ahead, on AMX hosts too (an AMX host runs AVX-512
# VNNI). Zen 4 dev machine (qwen3 layer, interleaved, min ms): T=1 0.70 vs 0.79 on one thread, T=4 / 8
# 1.54 / 2.91 vs 1.63 / 3.10 on two (results/profile_moe_s6_dev_i4pfl_t*.json). 16-core Emerald
# Rapids, 16 threads: T=1 0.18 vs 0.20, T=4 0.55 vs 0.65 against every other line 2 KB ahead
# (gemv_int4_pf, the AMX hosts' kernel before; results/profile_moe_s7_run1_i4pfl.json).
register("gemv", S.INT4, "avx512_vnni", f"{_M}.kernels_avx512:gemv_int4_pfl", priority=1)
register("gemm", S.INT4, "avx512_vnni", f"{_M}.kernels_avx512:gemm_int4")
register("gemv", S.BF16, "avx512_bf16", f"{_M}.kernels_avx512:gemv_bf16")
register("gemm", S.BF16, "avx512_bf16", f"{_M}.kernels_avx512:gemm_bf16")
# AVX2 (kernels_avx2.py): every scheme; also what the plain "avx512" variant runs.
register("gemv", S.INT8, "avx2", f"{_M}.kernels_avx2:gemv_int8")
register("gemm", S.INT8, "avx2", f"{_M}.kernels_avx2:gemm_int8")
register("gemv", S.INT4, "avx2", f"{_M}.kernels_avx2:gemv_int4")
register("gemm", S.INT4, "avx2", f"{_M}.kernels_avx2:gemm_int4")
register("gemv", S.BF16, "avx2", f"{_M}.kernels_avx2:gemv_bf16")
register("gemm", S.BF16, "avx2", f"{_M}.kernels_avx2:gemm_bf16")
