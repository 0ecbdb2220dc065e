"""AMX kernels on an AMX host (the device machine): correctness sweep, tile peak, kernel timings.

Run from the repository root:  PYTHONPATH=. python3 benchmarks/device_amx.py
Writes amx_device.json (and prints a table) into $OUT if set, else benchmarks/results/.

1. correctness: ``python3 -m pytest -q tests/cpu_ops/test_amx.py`` in a subprocess when pytest is
   installed, else a built-in subset of the same checks;
2. the tile-resident peak (``peak_int8`` / ``peak_bf16``) on one core (and on every core at once);
3. every AMX kernel (gemv / gemm x INT8 / INT4 G=64,128 / BF16) at M in {1, 32, 512, 2048} for
   (N, D) = (1536, 2048) and (2048, 768), one thread, weights warm (repeated calls): min and median
   time, TOPS (2 M N D / t), fraction of the one-core peak of its instruction; first-call time
   (compile, fresh cache) of each kernel;
4. sweeps of the tuning arguments: (mc, kc, prefetch) of the large-M kernels at M=512, and the
   B prefetch distance of the small-M kernels with warm and cold weights.
Every section is guarded: a failure is recorded and the script carries on; the JSON is rewritten
after each section, so a crash still leaves what was measured.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
OUT.mkdir(parents=True, exist_ok=True)
JSON_PATH = OUT / "amx_device.json"

os.environ.setdefault("KT_CACHE_DIR", tempfile.mkdtemp(prefix="kt-amx-cache-"))

DRY = "--dry-run" in sys.argv  # exercise this script on a host without AMX (emulated tiles, tiny)
SHAPES = ((48, 256), (32, 128)) if DRY else ((1536, 2048), (2048, 768))
MS = (1, 33) if DRY else (1, 32, 512, 2048)
PEAK_ITERS = 20 if DRY else 1_000_000

RESULT: dict = {"dry_run": DRY, "script": "benchmarks/device_amx.py", "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def save():
    JSON_PATH.write_text(json.dumps(RESULT, indent=1, default=str))


def section(name):
    def deco(fn):
        def run(*a, **k):
            t = time.perf_counter()
            print(f"\n=== {name} ===", flush=True)
            try:
                RESULT[name] = fn(*a, **k)
            except Exception as exc:  # keep going: record and report
                RESULT[name] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-4000:]}
                print(RESULT[name]["traceback"], flush=True)
            RESULT.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 2)
            save()
            return RESULT[name]
        return run
    return deco


@section("environment")
def environment():
    import llvmlite
    import numba

    from kt.cpu_ops import isa

    sel = isa.detect()
    host = sel.host
    env = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
           "llvmlite": llvmlite.__version__, "cpu_model": host.model_name, "llvm_cpu": host.cpu_name,
           "amx_features": sorted(f for f in host.features if f.startswith("amx")),
           "amx_permission": host.amx_permission, "amx_error": host.amx_error,
           "variant": sel.variant, "runnable": list(isa.runnable_variants()),
           "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
           "pytest": importlib.util.find_spec("pytest") is not None,
           "kt_cache_dir": os.environ["KT_CACHE_DIR"]}
    print(json.dumps(env, indent=1), flush=True)
    return env


@section("correctness")
def correctness():
    if DRY:
        return {"runner": "skipped (dry run)"}
    if importlib.util.find_spec("pytest") is not None:
        t = time.perf_counter()
        # its own cache dir, so this process still measures the first-call compile time
        env = dict(os.environ, PYTHONPATH=str(ROOT), KT_CACHE_DIR=tempfile.mkdtemp(prefix="kt-pt-"))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/cpu_ops/test_amx.py"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=200)
        tail = (proc.stdout + proc.stderr)[-6000:]
        print(tail, flush=True)
        summary = [ln for ln in proc.stdout.splitlines() if " passed" in ln or " failed" in ln
                   or " error" in ln]
        return {"runner": "pytest", "returncode": proc.returncode,
                "summary": summary[-1] if summary else None, "seconds": round(time.perf_counter() - t, 1),
                "output_tail": tail}
    return {"runner": "builtin", **builtin_checks()}


_K = None


def load_kernels():
    """kt.cpu_ops.kernels_amx, or with --dry-run its Python bodies on the test's tile-unit model."""
    global _K
    if _K is None:
        if DRY:
            sys.path.insert(0, str(ROOT))
            import pytest

            from tests.cpu_ops import test_amx as T

            _K = T.emulated_kernels(pytest.MonkeyPatch())
        else:
            from kt.cpu_ops import kernels_amx

            _K = kernels_amx
    return _K


def _pad(a, d_pad):
    out = np.zeros((a.shape[0], d_pad), a.dtype)
    out[:, : a.shape[1]] = a
    return out


def call(K, scheme, op, x_in, p, out, nb0=0, nb1=None):
    """x_in: (xq_padded, xs) for integer schemes, xb_padded for BF16."""
    nb1 = p.num_blocks if nb1 is None else nb1
    if scheme == "bf16":
        getattr(K, f"{op}_bf16")(x_in, p.data, out, nb0, nb1)
    elif scheme == "int8":
        getattr(K, f"{op}_int8")(x_in[0], x_in[1], p.data, p.scale, p.wsum, out, nb0, nb1)
    else:
        getattr(K, f"{op}_int4")(x_in[0], x_in[1], p.data, p.scale, p.group_size, out, nb0, nb1)


def prepare(scheme, x, p):
    from kt import reference as ref

    if scheme == "bf16":
        return _pad(ref.f32_to_bf16_bits(x), p.d_pad)
    xq, xs = ref.quantize_act(x)
    return _pad(xq, p.d_pad), xs


def reference_and_bound(scheme, x, w, g):
    """(ref [M, N], elementwise tolerance): the bounds of tests/cpu_ops/test_amx.py."""
    from kt import reference as ref

    u = 2.0 ** -24
    if scheme == "bf16":
        xr, wr = ref.bf16_round(x), ref.dequantize(ref.quantize(w, "bf16"))
        want = ref.linear(xr, wr)
        terms = np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T
        return want, x.shape[1] * u * terms
    qw = ref.quantize(w, scheme, g or 64)
    xd = ref.act_roundtrip(x, "int8")
    wd = ref.dequantize(qw)
    want = ref.linear(xd, wd)
    terms = np.abs(xd).astype(np.float64) @ np.abs(wd).astype(np.float64).T
    groups = (-(-x.shape[1] // max(64, g)) * max(64, g)) // g if scheme == "int4" else 0
    return want, 1e-5 * np.abs(want) + (2 + groups) * u * terms


def builtin_checks():
    K = load_kernels()
    from kt.cpu_ops.packing import pack

    rng = np.random.default_rng(0)
    fails, n_ok = [], 0
    for scheme, g in (("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("bf16", 0)):
        for m in (1, 2, 7, 16, 33, 512):
            for n, d in ((16, 64), (100, 200), (48, 256), (72, 2048)):
                x = rng.standard_normal((m, d), dtype=np.float32)
                w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
                p = pack(w, scheme, g or 64)
                want, bound = reference_and_bound(scheme, x, w, g)
                for op in ("gemv", "gemm"):
                    out = np.full((m, p.n_pad), np.nan, np.float32)
                    call(K, scheme, op, prepare(scheme, x, p), p, out)
                    err = np.abs(out[:, :n].astype(np.float64) - want)
                    bad = ~(err <= bound) | (out[:, n:] != 0).any()
                    if bad.any():
                        fails.append(f"{op} {scheme} G={g} M={m} N={n} D={d}: "
                                     f"{int(np.sum(~(err <= bound)))} bad, max err {np.nanmax(err):.3g}")
                    else:
                        n_ok += 1
    print(f"builtin checks: {n_ok} ok, {len(fails)} failed", flush=True)
    for f in fails[:20]:
        print("  FAIL", f, flush=True)
    return {"ok": n_ok, "failed": len(fails), "failures": fails[:50]}


def _time(fn, min_reps=3, max_reps=50, budget_s=0.4):
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    reps = int(min(max_reps, max(min_reps, budget_s / max(first, 1e-6))))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts), reps


@section("peak")
def peak():
    """One core, tiles resident. (The all-core figure runs last: an all-core AMX load can leave the
    package in a lower-clock state that would colour the single-thread timings after it.)"""
    K = load_kernels()

    res = {}
    for name, fn in (("int8", K.peak_int8), ("bf16", K.peak_bf16)):
        t = time.perf_counter()
        fn(10)
        first = time.perf_counter() - t
        iters = PEAK_ITERS
        ops = fn(iters)
        tmin, tmed, _ = _time(lambda: fn(iters), min_reps=5, max_reps=5)
        one = ops / tmin / 1e12
        res[name] = {"tops_one_core": round(one, 3), "iters": iters, "ops": int(ops),
                     "t_min_s": tmin, "t_median_s": tmed, "first_call_s": round(first, 3)}
        print(f"{name}: {one:.3f} TOPS one core (tile-resident)", flush=True)
    return res


@section("peak_all_cores")
def peak_all_cores():
    """Every core at once (Python threads calling the nogil tile loop)."""
    from bench_gemm import threads_wall  # (benchmarks/ is on sys.path when run as a script)

    K = load_kernels()
    res = {}
    nthr = len(os.sched_getaffinity(0))
    for name, fn in (("int8", K.peak_int8), ("bf16", K.peak_bf16)):
        ops = fn(PEAK_ITERS)
        wall = threads_wall(lambda i, fn=fn: fn(PEAK_ITERS), nthr)
        res[name] = {"threads": nthr, "tops_all_cores": round(nthr * ops / wall / 1e12, 2)}
        print(f"{name}: {res[name]['tops_all_cores']} TOPS on {nthr} threads", flush=True)
    return res


@section("kernels")
def kernels():
    K = load_kernels()
    from kt.cpu_ops.packing import pack

    peaks = RESULT.get("peak", {})
    rows, checks, retime = [], [], []
    first_call = {}
    rng = np.random.default_rng(1)
    for n, d in SHAPES:
        w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
        for scheme, g in (("int8", 0), ("int4", 64), ("int4", 128), ("bf16", 0)):
            try:
                p = pack(w, scheme, g or 64)
            except Exception as exc:
                rows.append({"scheme": scheme, "G": g, "N": n, "D": d, "error": repr(exc)})
                continue
            pk = (peaks.get("bf16" if scheme == "bf16" else "int8") or {}).get("tops_one_core")
            for m in MS:
                x = rng.standard_normal((m, d), dtype=np.float32)
                xin = prepare(scheme, x, p)
                for op in ("gemv", "gemm"):
                    row = {"op": op, "scheme": scheme, "G": g, "N": n, "D": d, "M": m}
                    try:
                        out = np.empty((m, p.n_pad), np.float32)
                        key = f"{op}_{scheme}"
                        if key not in first_call:
                            t = time.perf_counter()
                            call(K, scheme, op, xin, p, out)
                            first_call[key] = round(time.perf_counter() - t, 3)
                        tmin, tmed, reps = _time(lambda: call(K, scheme, op, xin, p, out))
                        tops = 2.0 * m * n * d / tmin / 1e12
                        row.update(t_min_us=round(tmin * 1e6, 1), t_median_us=round(tmed * 1e6, 1),
                                   reps=reps, tops=round(tops, 4),
                                   frac_peak=round(tops / pk, 4) if pk else None)
                        if m in (1, 33, 512):
                            # checked after all timings: numpy's multi-threaded BLAS in the
                            # reference must not run between two timed kernels
                            checks.append((row, scheme, g, x, w, out[:, :n].copy()))
                        if scheme == "int8" and op == "gemm" and m == (33 if DRY else 512):
                            retime.append((row, lambda xin=xin, p=p, out=out:
                                           call(K, "int8", "gemm", xin, p, out)))
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    RESULT["kernels_partial"] = rows
                    save()
    for row, fn in retime:  # the same call again, later: shows drift of the machine state
        row["t_min_us_repeat"] = round(_time(fn)[0] * 1e6, 1)
        print("repeat", json.dumps(row), flush=True)
    for row, scheme, g, x, w, got in checks:
        want, bound = reference_and_bound(scheme, x, w, g)
        row["within_tolerance"] = bool((np.abs(got.astype(np.float64) - want) <= bound).all())
    RESULT.pop("kernels_partial", None)
    return {"rows": rows, "first_call_s": first_call,
            "note": "one thread; weights warm (repeated calls on the same matrix)"}


def _sweep_row(fn, ops, pk, **params):
    tmin, tmed, _ = _time(fn, max_reps=10, budget_s=0.15)
    tops = ops / tmin / 1e12
    row = dict(params, t_min_us=round(tmin * 1e6, 1), t_median_us=round(tmed * 1e6, 1),
               tops=round(tops, 3), frac_peak=round(tops / pk, 3) if pk else None)
    print(json.dumps(row), flush=True)
    return row


@section("gemm_sweep")
def gemm_sweep():
    """(mc, kc, prefetch) of the large-M kernels at M=512, N=1536, D=2048 (one thread)."""
    from kt import reference as ref
    from kt.cpu_ops.packing import pack

    K = load_kernels()
    rng = np.random.default_rng(2)
    m, n, d = (40, 48, 256) if DRY else (512, 1536, 2048)
    w = rng.standard_normal((n, d), dtype=np.float32)
    x = rng.standard_normal((m, d), dtype=np.float32)
    xq, xs = ref.quantize_act(x)
    xb = ref.f32_to_bf16_bits(x)
    ops = 2.0 * m * n * d
    pk8 = (RESULT.get("peak", {}).get("int8") or {}).get("tops_one_core")
    pkb = (RESULT.get("peak", {}).get("bf16") or {}).get("tops_one_core")
    res = {"shape": {"M": m, "N": n, "D": d}, "int8": [], "bf16": [], "int4_g64": []}
    p8 = pack(w, "int8")
    out = np.empty((m, p8.n_pad), np.float32)
    for mc in ((32,) if DRY else (64, 128, 256)):
        for kcs in ((2, 4) if DRY else (8, 16, 32)):
            for pf in (0, 2):
                res["int8"].append(_sweep_row(
                    lambda: K.gemm_int8_blocked(xq, xs, p8.data, p8.scale, out, 0, p8.num_blocks,
                                                mc, kcs, pf), ops, pk8, mc=mc, kcs=kcs, pf=pf))
    save()
    pb = pack(w, "bf16")
    for mc in ((32,) if DRY else (128, 256)):
        for kcs in ((2, 4) if DRY else (16, 32, 64)):
            for pf in (0, 2):
                res["bf16"].append(_sweep_row(
                    lambda: K.gemm_bf16_blocked(xb, pb.data, out, 0, pb.num_blocks, mc, kcs, pf),
                    ops, pkb, mc=mc, kcs=kcs, pf=pf))
    save()
    p4 = pack(w, "int4", 64)
    for mc in ((32,) if DRY else (128, 256)):
        for kc in ((128, 256) if DRY else (256, 512, 1024, 2048)):
            res["int4_g64"].append(_sweep_row(
                lambda: K.gemm_int4_blocked(xq, xs, p4.data, p4.scale, 64, out, 0, p4.num_blocks,
                                            mc, kc, False, False), ops, pk8, mc=mc, kc=kc))
    return res


@section("gemv_sweep")
def gemv_sweep():
    """B prefetch distance of the small-M kernels, warm (one matrix) and cold (a pool of copies
    far larger than the caches, used in turn), N=1536, D=2048, one thread."""
    from kt import reference as ref
    from kt.cpu_ops.packing import pack

    K = load_kernels()
    rng = np.random.default_rng(3)
    n, d = (48, 256) if DRY else (1536, 2048)
    pool_bytes = (1 << 20) if DRY else (96 << 20)
    w = rng.standard_normal((n, d), dtype=np.float32)
    res = {"shape": {"N": n, "D": d}, "rows": []}
    for scheme in ("int8", "bf16", "int4"):
        p = pack(w, scheme, 64)
        copies = max(2, pool_bytes // p.data.nbytes)
        pool = [p.data.copy() for _ in range(copies)]
        for m in (1, 8):
            x = rng.standard_normal((m, d), dtype=np.float32)
            out = np.empty((m, p.n_pad), np.float32)
            xq, xs = ref.quantize_act(x)
            xb = ref.f32_to_bf16_bits(x)
            for pf in (0, 4) if scheme != "int4" else (0, 1, 2):
                for cold in (False, True):
                    def one(data):
                        if scheme == "int8":
                            K.gemv_int8_pf(xq, xs, data, p.scale, out, 0, p.num_blocks, pf)
                        elif scheme == "bf16":
                            K.gemv_bf16_pf(xb, data, out, 0, p.num_blocks, pf)
                        else:  # pf counts groups of 64 here
                            K.gemv_int4_pf(xq, xs, data, p.scale, 64, out, 0, p.num_blocks, pf)

                    if cold:
                        def fn():
                            for data in pool:
                                one(data)
                        per = len(pool)
                    else:
                        def fn():
                            one(p.data)
                        per = 1
                    tmin, tmed, _ = _time(fn, min_reps=3, max_reps=10, budget_s=0.3)
                    row = {"scheme": scheme, "M": m, "pf": pf, "cold": cold,
                           "t_min_us": round(tmin / per * 1e6, 1),
                           "t_median_us": round(tmed / per * 1e6, 1),
                           "weight_GBps": round(p.data.nbytes / (tmin / per) / 1e9, 1)}
                    res["rows"].append(row)
                    print(json.dumps(row), flush=True)
        del pool
    return res


def table():
    lines = ["| op | scheme | G | N | D | M | min us | median us | TOPS | frac of peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (RESULT.get("kernels") or {}).get("rows", []):
        if "error" in r:
            lines.append(f"| {r.get('op')} | {r['scheme']} | {r['G']} | {r['N']} | {r['D']} | "
                         f"{r.get('M')} | error: {r['error'][:60]} | | | |")
            continue
        lines.append(f"| {r['op']} | {r['scheme']} | {r['G'] or ''} | {r['N']} | {r['D']} | {r['M']} | "
                     f"{r['t_min_us']} | {r['t_median_us']} | {r['tops']} | {r['frac_peak']} |")
    return "\n".join(lines)


def main():
    env = environment()
    if not DRY and ("error" in env or "amx" not in env.get("runnable", [])):
        print("AMX is not runnable here: only the environment is reported", flush=True)
        RESULT["finished"] = False
        save()
        return 1
    correctness()
    peak()
    kernels()
    gemm_sweep()
    gemv_sweep()
    peak_all_cores()
    print("\n" + table(), flush=True)
    RESULT["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    save()
    print(f"\nwrote {JSON_PATH}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
