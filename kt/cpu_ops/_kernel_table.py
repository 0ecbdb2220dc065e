"""The built-in kernels: (op, scheme, variant) -> "module:attribute", with their named forms.

Data only (read by ``registry``; nothing here imports it back). Ops, whose contract every kernel
module implements (kt/cpu_ops/README.md): ``gemv`` small-M GEMM (decode), ``gemm`` large-M GEMM
(prefill). The variant of an entry is the lowest ISA it needs. Forms are other kernels of the same
file that callers take in place of the contract one, by name (``registry.KernelSet`` says when):

  tab         INT4: the same product on the layer's ratio tables (``packing.int4_ratio_table``)
  tab_stream  INT4: ``tab`` with non-temporal output stores (a MoE layer's large-chunk down GEMM)
  exact       INT4: the large-M kernel exact for a stored -8 (``packing.int4_has_minus8``)
  layer       the large-M kernel a MoE layer runs on its shared gate+up / down rows
  layer_stream  ``layer`` with non-temporal output stores (a MoE layer's large-chunk down GEMM)

``gemv_max``: largest M for which a gemm entry's family takes its gemv (``tiling``); ``reads_wsum``:
the kernel reads the packed per-row sums (vpdpbusd's +128 offset).
"""
from ..config import QuantScheme as S

_AMX = "kt.cpu_ops.kernels.amx"
_AVX512 = "kt.cpu_ops.kernels.avx512"
_AVX2 = "kt.cpu_ops.kernels.avx2"

# (op, scheme, variant, target, options)
KERNELS = (
    # AMX tiles (kernels/amx/; importing a kernel file raises unless isa found AMX runnable).
    # gemv_max 4: the AMX GEMV costs the same for M = 1..8 (one A tile), its GEMM pads M to 32.
    ("gemv", S.INT8, "amx", f"{_AMX}.int8:gemv_int8", {}),
    ("gemm", S.INT8, "amx", f"{_AMX}.int8:gemm_int8",
     {"gemv_max": 4, "forms": {"layer": f"{_AMX}.int8:gemm_int8_shared_out",
                               "layer_stream": f"{_AMX}.int8:gemm_int8_stream_out"}}),
    ("gemv", S.INT4, "amx", f"{_AMX}.int4:gemv_int4", {}),
    ("gemm", S.INT4, "amx", f"{_AMX}.int4:gemm_int4",
     {"gemv_max": 4, "forms": {"exact": f"{_AMX}.int4:gemm_int4_flush",
                               "tab": f"{_AMX}.int4:gemm_int4_tab",
                               "tab_stream": f"{_AMX}.int4:gemm_int4_tab_stream_out"}}),
    ("gemv", S.BF16, "amx", f"{_AMX}.bf16:gemv_bf16", {}),
    ("gemm", S.BF16, "amx", f"{_AMX}.bf16:gemm_bf16",
     {"gemv_max": 4, "forms": {"layer_stream": f"{_AMX}.bf16:gemm_bf16_stream_out"}}),
    # AVX-512 (kernels/avx512.py): INT8 / INT4 need VNNI (vpdpbusd), BF16 needs AVX512_BF16.
    # Decode: on the AMX Xeon (14 threads, qwen3-30b-a3b layer, benchmarks/decode_variants.py)
    # the VNNI gemv beat the AMX gemv: INT8 T=1 0.35 vs 0.43 ms, INT4 T=1 0.21 vs 0.32 ms (BF16:
    # AMX 0.79 vs 0.86 ms), so it is preferred where both run (priority 1).
    ("gemv", S.INT8, "avx512_vnni", f"{_AVX512}:gemv_int8", {"priority": 1, "reads_wsum": True}),
    ("gemm", S.INT8, "avx512_vnni", f"{_AVX512}:gemm_int8", {"reads_wsum": True}),
    # The INT4 gemv prefetches every packed line 4 KB ahead, on AMX hosts too (an AMX host runs
    # AVX-512 VNNI). Zen 4 (qwen3 layer, interleaved, min ms; benchmarks/profile_moe.py): T=1
    # 0.70 vs 0.79 on one thread, T=4 / 8 1.54 / 2.91 vs 1.63 / 3.10 on two. 16-core Emerald
    # Rapids, 16 threads: T=1 0.18 vs 0.20, T=4 0.55 vs 0.65 against every other line 2 KB ahead.
    ("gemv", S.INT4, "avx512_vnni", f"{_AVX512}:gemv_int4_pfl",
     {"priority": 1, "forms": {"tab": f"{_AVX512}:gemv_int4_tab"}}),
    ("gemm", S.INT4, "avx512_vnni", f"{_AVX512}:gemm_int4", {}),
    ("gemv", S.BF16, "avx512_bf16", f"{_AVX512}:gemv_bf16", {}),
    ("gemm", S.BF16, "avx512_bf16", f"{_AVX512}:gemm_bf16", {}),
    # AVX2 (kernels/avx2.py): every scheme; also what the plain "avx512" variant runs.
    ("gemv", S.INT8, "avx2", f"{_AVX2}:gemv_int8", {}),
    ("gemm", S.INT8, "avx2", f"{_AVX2}:gemm_int8", {}),
    ("gemv", S.INT4, "avx2", f"{_AVX2}:gemv_int4", {}),
    ("gemm", S.INT4, "avx2", f"{_AVX2}:gemm_int4", {}),
    ("gemv", S.BF16, "avx2", f"{_AVX2}:gemv_bf16", {}),
    ("gemm", S.BF16, "avx2", f"{_AVX2}:gemm_bf16", {}),
)
