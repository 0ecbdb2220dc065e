"""Layers, routings and the tight check shared by the CPUMoE and driver tests.

Tight checks compare with ``reference.moe_forward_quantized`` (the exact math of the kernels:
activations rounded per token as the kernels see them, dequantised weights). The integer dot
products are exact, so the differences are fp32 rounding only: the SiLU's expf (LLVM vs numpy,
<= 1 ulp), fp32 epilogues (INT4 sums its group partials in fp32), fp32 vs fp64 accumulation in
the combine and in the BF16 GEMMs: ~1e-6 relative. One effect is larger but rare: such a 1-ulp
difference can move an element of h across a rounding boundary of its int8 requantisation, which
changes that token's output by ~1e-3 of its norm. Hence: the whole output within 1e-4 relative
(norm), and every token's row within 5e-3.
"""
import numpy as np

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops import isa, registry
from kt.cpu_ops.moe import CPUMoE
from kt.cpu_ops.packing import unpack
from kt.testing import random_expert_weights

from _moe_doubles import DOUBLES

SCHEMES = ("int8", "int4", "bf16")


def _has_kernels(scheme, variant=None):
    try:
        registry.lookup("gemv", scheme, variant)
        return True
    except NotImplementedError:
        try:
            registry.lookup("gemm", scheme, variant)
            return True
        except NotImplementedError:
            return False


def _real_variants():
    """(scheme, variant) pairs with registered kernels, one per distinct kernel set."""
    out = []
    for s in SCHEMES:
        seen = set()
        for v in isa.runnable_variants():
            if not _has_kernels(s, v):
                continue
            key = tuple(registry.lookup(op, s, v).target for op in ("gemv", "gemm")
                        if registry.candidates(op, QuantScheme.parse(s), v))
            if key not in seen:
                seen.add(key)
                out.append((s, v))
    return out


REAL = _real_variants()
BEST = [(s, v) for (s, v) in REAL if v == isa.cpu_variant() or
        all(v2 != isa.cpu_variant() for (s2, v2) in REAL if s2 == s)]
BEST = list({s: (s, v) for (s, v) in REAL}.values()) if not BEST else BEST


_cache = {}


def layer(scheme, kind, E=8, H=200, I=100, pool=None, **kw):
    """kind: 'double' (scalar test kernels) or a variant name (registry kernels)."""
    key = (scheme, kind, E, H, I, id(pool), tuple(sorted(kw.items())))
    if key not in _cache:
        g, u, d = random_expert_weights(E, H, I, seed=E + H + I)
        if kind == "double":
            m = CPUMoE.from_tensors(g, u, d, scheme=scheme, pool=pool, kernels=DOUBLES[scheme], **kw)
        else:
            m = CPUMoE.from_tensors(g, u, d, scheme=scheme, pool=pool, variant=kind, **kw)
        _cache[key] = (m, g, u, d)
    return _cache[key]


def quantized_ref(m, x, ids, w, mask=None):
    q13 = [unpack(m.w13.expert(e)) for e in range(m.num_experts)]
    q2 = [unpack(m.w2.expert(e)) for e in range(m.num_experts)]
    return ref.moe_forward_quantized(x, ids, w, q13, q2, skip_mask=mask,
                                     activations=m.activations)


def routing(rng, T, E, K, skip_frac=0.1):
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]) if T else np.zeros((0, K), np.int64)
    ids = ids.astype(np.int64)
    ids[rng.random(ids.shape) < skip_frac] = -1
    w = rng.random((T, K), dtype=np.float32)
    return ids, w


def check_tight(m, x, ids, w, out, mask=None, what="", whole=1e-4):
    """whole: the bound on the whole output's relative error. One row moved by a requantisation
    flip (the rare effect above, <= 5e-3 of its norm) moves the whole output of T rows by about
    5e-3 / sqrt(T): tests that may meet one pass a larger bound (AMX INT8 meets one at T=120)."""
    r = quantized_ref(m, x, ids, w, mask).astype(np.float64)
    o = np.asarray(out, np.float64)
    assert o.shape == r.shape, what
    if not r.size:
        return
    err = ref.relative_error(o, r)
    assert err <= whole, f"{what}: relative error {err:.3g} > {whole}"
    d = np.linalg.norm(o - r, axis=1)
    n = np.linalg.norm(r, axis=1)
    bad = d > 5e-3 * n + 1e-6 * (n.max() + 1e-30)
    assert not bad.any(), (f"{what}: rows {np.nonzero(bad)[0][:8]} off by "
                           f"{(d[bad] / np.maximum(n[bad], 1e-30))[:8]} (relative)")
