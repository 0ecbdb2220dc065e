"""kt vs kt-kernel 0.7.2, side by side in one process, interleaved, on the same shapes and routing.

kt-kernel's extension is driven directly (its KTMoEWrapper wants a CUDA driver for pinned memory),
as ../shared/notes/kt-kernel.md describes: CPUInfer(threads), moe.MOEConfig(E, K, H, I, 0) with the
bf16 gate/up/down pointers, AMXInt8_MOE / AMXInt4_MOE / AMXBF16_MOE, load_weights_task, then
forward_task per call. Each side cycles through its own copies of the layer (cold weights), and
every call gets fresh uniform routing; kt and kt-kernel calls alternate.

Device use (the cp312 wheel's kt_kernel/ and kt_kernel.libs/ carried under .ktk/):
    PYTHONPATH=. python3 benchmarks/baseline_ktkernel.py --ktk .ktk --threads 15 --out $OUT

``--serve`` runs one side as a server for ``pair_ktkernel.py``, which alternates the calls of two
such processes (kt's and kt-kernel's, each with only its own threads) call by call.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_moe import _copy  # noqa: E402  (this script's folder is on sys.path)
from kt.cpu_ops.moe import CPUMoE  # noqa: E402
from kt.cpu_ops.pool import CpuPool  # noqa: E402

SCHEMES = {"int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE", "bf16": "AMXBF16_MOE"}


def load_ext(root: str, variant: str = "amx"):
    so = next(Path(root, "kt_kernel").glob(f"_kt_kernel_ext_{variant}.cpython-*.so"))
    loader = importlib.machinery.ExtensionFileLoader("kt_kernel_ext", str(so))
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules["kt_kernel_ext"] = mod
    return mod


class KtKernelLayer:
    def __init__(self, ext, cpuinfer, scheme, gate, up, down, max_len):
        E, I, H = gate.shape
        self.keep = (gate, up, down)  # kt-kernel reads these while it quantises
        self.ext = ext
        self.cpuinfer = cpuinfer
        self.E, self.H, self.I = E, H, I
        self.max_len = max_len
        self.scheme = scheme
        self.moe = None

    def build(self, K):
        ext = self.ext
        gate, up, down = self.keep
        cfg = ext.moe.MOEConfig(self.E, K, self.H, self.I, 0)
        cfg.pool = self.cpuinfer.backend_
        cfg.max_len = self.max_len
        cfg.gate_proj = gate.data_ptr()
        cfg.up_proj = up.data_ptr()
        cfg.down_proj = down.data_ptr()
        self.moe = getattr(ext.moe, SCHEMES[self.scheme])(cfg)
        self.p2l = torch.arange(self.E, dtype=torch.int64)
        self.cpuinfer.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        self.cpuinfer.sync()

    def __call__(self, x, ids, w, out, qlen):
        self.cpuinfer.submit(self.moe.forward_task(qlen.data_ptr(), ids.shape[1], ids.data_ptr(),
                                                   w.data_ptr(), x.data_ptr(), out.data_ptr()))
        self.cpuinfer.sync()


def routing(gen, T, E, K):
    ids = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=gen)
    return ids, (w / w.sum(1, keepdim=True)).contiguous()


def serve(a, ext, E, K, H, I, max_len):
    """One side (a.side) as a server on stdin / stdout, one command per line: ``build SCHEME``
    (a.copies fresh copies, replacing the last scheme's) -> ``@@built SECONDS``; ``calls T SEED N``
    (x and routing drawn from SEED, so both sides get the same inputs; N calls back to back, each
    on the next copy, after an untimed one-token call) -> ``@@`` and the N calls' seconds;
    ``idle T S`` (a call, then S seconds idle) -> the cores busy meanwhile;
    ``quit``. It says ``@@ready`` first."""
    cpuinfer = ext.CPUInfer(a.threads) if a.side == "ktkernel" else None
    pool = CpuPool(a.threads) if a.side == "kt" else None
    gen = torch.Generator().manual_seed(1)
    layers, n = [], 0

    def inputs(g, t):  # one call's operands (both sides get the same from the same generator)
        x = (torch.randn(t, H, generator=g) * 0.5).to(torch.bfloat16).contiguous()
        ids, w = routing(g, t, E, K)
        return x, ids, w, torch.empty(t, H, dtype=torch.bfloat16), torch.tensor([t], dtype=torch.int32)

    def run(layer, x, ids, w, out, qlen):
        if a.side == "ktkernel":
            layer(x, ids, w, out, qlen)
        else:
            layer(x, ids, w)

    print("@@ready", flush=True)  # replies start with @@: the libraries print lines of their own
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "build":
            # the copies hold the same values in their own memory (cold weights, built fast)
            t0 = time.time()
            layers = []
            g = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
            u = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
            d = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16).contiguous()
            for c in range(a.copies):
                if a.side == "ktkernel":  # its own source copy too, should it read from it
                    kl = KtKernelLayer(ext, cpuinfer, cmd[1], g.clone(), u.clone(), d.clone(), max_len)
                    kl.build(K)
                    layers.append(kl)
                elif c == 0:
                    layers.append(CPUMoE.from_tensors(g, u, d, scheme=cmd[1], pool=pool))
                else:
                    layers.append(CPUMoE(_copy(layers[0].w13), _copy(layers[0].w2), pool=pool))
            print(f"@@built {time.time() - t0:.1f}", flush=True)
        elif cmd[0] == "idle":
            # cores this process keeps busy during the S seconds after a call: its workers' spin
            T, secs = int(cmd[1]), float(cmd[2])
            run(layers[0], *inputs(gen, T))
            c0, t0 = time.process_time(), time.perf_counter()
            time.sleep(secs)
            print(f"@@{(time.process_time() - c0) / (time.perf_counter() - t0):.3f}", flush=True)
        elif cmd[0] == "calls":
            # inputs first, then an untimed one-token call (after an idle gap the workers are
            # asleep), then the timed calls back to back, each on the next copy
            T, seed, reps = int(cmd[1]), int(cmd[2]), int(cmd[3])
            g2 = torch.Generator().manual_seed(seed)
            args = [inputs(g2, t) for t in [1] + [T] * reps]
            times = []
            for arg in args:
                layer = layers[n % len(layers)]
                n += 1
                t0 = time.perf_counter()
                run(layer, *arg)
                times.append(time.perf_counter() - t0)
            print("@@" + " ".join(f"{t:.9f}" for t in times[1:]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ktk", default=".ktk")
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--shape", default="128,8,2048,768")
    ap.add_argument("--T", default="1,32,512,2048")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--side", default="both", choices=["both", "kt", "ktkernel"],
                    help="one side alone: no spinning threads of the other library in the process")
    ap.add_argument("--serve", action="store_true",
                    help="run --side kt or ktkernel as a server for pair_ktkernel.py (see serve)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    t_start = time.time()
    E, K, H, I = (int(v) for v in a.shape.split(","))
    Ts = [int(t) for t in a.T.split(",")]
    if a.serve:
        if a.side == "both":
            ap.error("--serve runs one side: --side kt or --side ktkernel")
        serve(a, load_ext(a.ktk) if a.side == "ktkernel" else None, E, K, H, I,
              max(512, -(-max(Ts) // 512) * 512))
        return
    res = {"shape": dict(E=E, K=K, H=H, I=I), "threads": a.threads, "rows": [], "errors": {}}
    out_path = Path(a.out, f"ktkernel_vs_kt_{a.side}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        ext = load_ext(a.ktk)
        res["ktkernel_variant"] = getattr(ext, "__cpu_variant__", "amx")
    except Exception:
        res["errors"]["load"] = traceback.format_exc()
        out_path.write_text(json.dumps(res, indent=1))
        print(res["errors"]["load"])
        return
    cpuinfer = ext.CPUInfer(a.threads) if a.side != "kt" else None
    pool = CpuPool(a.threads) if a.side != "ktkernel" else None
    gen = torch.Generator().manual_seed(0)
    max_len = max(512, -(-max(Ts) // 512) * 512)
    for scheme in a.schemes.split(","):
        if time.time() - t_start > a.budget_s:
            res["errors"][scheme] = "skipped: time budget"
            continue
        try:
            kt_layers, ktk_layers = [], []
            for c in range(a.copies):
                g = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
                u = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
                d = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16).contiguous()
                if a.side != "kt":
                    kl = KtKernelLayer(ext, cpuinfer, scheme, g, u, d, max_len)
                    kl.build(K)
                    ktk_layers.append(kl)
                if a.side != "ktkernel":
                    kt_layers.append(CPUMoE.from_tensors(g, u, d, scheme=scheme, pool=pool))
            print(f"{scheme}: built {a.copies} copies of each side ({time.time() - t_start:.0f} s)",
                  flush=True)
            for T in Ts:
                x = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16).contiguous()
                out = torch.empty(T, H, dtype=torch.bfloat16)
                qlen = torch.tensor([T], dtype=torch.int32)
                t_kt, t_ktk = [], []
                agree = float("nan")
                # every call's routing made first: torch ops between the calls left OpenMP
                # threads busy, and the libraries' workers asleep (see pair_ktkernel.py)
                routes = [routing(gen, T, E, K) for _ in range(a.reps + 2)]
                for r in range(a.reps + 2):
                    ids, w = routes[r]
                    t0 = time.perf_counter()
                    if kt_layers:
                        kt_layers[r % a.copies](x, ids, w)
                    t1 = time.perf_counter()
                    if ktk_layers:
                        ktk_layers[r % a.copies](x, ids, w, out, qlen)
                    t2 = time.perf_counter()
                    if r >= 2:
                        t_kt.append(t1 - t0)
                        t_ktk.append(t2 - t1)
                    if r == 0 and kt_layers and ktk_layers:  # same weights and inputs: should agree
                        ref_y = kt_layers[0](x, ids, w).float()
                        ktk_layers[0](x, ids, w, out, qlen)
                        den = ref_y.norm().item() or 1.0
                        agree = (out.float() - ref_y).norm().item() / den
                row = dict(scheme=scheme, T=T, side=a.side, kt_min_ms=min(t_kt) * 1e3,
                           kt_med_ms=statistics.median(t_kt) * 1e3,
                           ktkernel_min_ms=min(t_ktk) * 1e3,
                           ktkernel_med_ms=statistics.median(t_ktk) * 1e3,
                           speedup_min=min(t_ktk) / max(min(t_kt), 1e-9),
                           speedup_med=statistics.median(t_ktk) / max(statistics.median(t_kt), 1e-9),
                           rel_diff_kt_vs_ktkernel=agree)
                res["rows"].append(row)
                print(f"{scheme} T={T:5d}: kt {row['kt_min_ms']:8.3f} ms (med {row['kt_med_ms']:8.3f})"
                      f"  kt-kernel {row['ktkernel_min_ms']:8.3f} ms (med {row['ktkernel_med_ms']:8.3f})"
                      f"  speedup {row['speedup_min']:.2f}x  rel diff {agree:.3f}", flush=True)
                out_path.write_text(json.dumps(res, indent=1))
            del kt_layers, ktk_layers
        except Exception:
            res["errors"][scheme] = traceback.format_exc()
            print(res["errors"][scheme], flush=True)
        out_path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
