"""One side of a kt / kt-kernel comparison, alone in its process: kt's CPUMoE or kt-kernel 0.7.2.

kt-kernel's extension is driven directly (its KTMoEWrapper wants a CUDA driver for pinned memory):
CPUInfer(threads), moe.MOEConfig(E, K, H, I, 0) with the bf16 gate/up/down pointers,
AMXInt8_MOE / AMXInt4_MOE / AMXBF16_MOE, load_weights_task, then forward_task per call. Its
extension is a cp312 build (``--ktk DIR``: a folder holding the wheel's ``kt_kernel/`` and
``kt_kernel.libs/``), so this script runs under a Python 3.12 with torch, numba and kt importable.

Each side holds ``--copies`` copies of the layer (cold weights: calls take them in turn) built from
the same random bf16 weights, and draws x and the routing from a seed, so both sides of a pair get
the same inputs. Two ways to run it:

- ``--serve --side kt|ktkernel``: a server for ``pair_ktkernel.py`` on stdin / stdout (see
  ``serve``), which alternates two such processes call by call;
- ``--side ktkernel`` (what ``bench_moe.py --baseline kt-kernel`` runs): every scheme and T timed
  here, ``--reps`` calls back to back after two untimed ones, written to ``--out``/ktkernel.json.
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
from kt.cpu_ops import CpuPool, CPUMoE  # noqa: E402

SCHEMES = {"int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE", "bf16": "AMXBF16_MOE"}


def load_ext(root: str, variant: str = "amx"):
    found = sorted(Path(root, "kt_kernel").glob(f"_kt_kernel_ext_{variant}.cpython-*.so"))
    if not found:
        raise FileNotFoundError(f"no kt_kernel/_kt_kernel_ext_{variant}.cpython-*.so under {root!r}")
    loader = importlib.machinery.ExtensionFileLoader("kt_kernel_ext", str(found[0]))
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", str(found[0]), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules["kt_kernel_ext"] = mod
    return mod


class KtKernelLayer:
    def __init__(self, ext, cpuinfer, scheme, gate, up, down, K, max_len):
        E, I, H = gate.shape
        self.keep = (gate, up, down)  # kt-kernel reads these while it quantises
        self.cpuinfer = cpuinfer
        cfg = ext.moe.MOEConfig(E, K, H, I, 0)
        cfg.pool = cpuinfer.backend_
        cfg.max_len = max_len
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        self.moe = getattr(ext.moe, SCHEMES[scheme])(cfg)
        self.p2l = torch.arange(E, dtype=torch.int64)
        cpuinfer.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        cpuinfer.sync()

    def __call__(self, x, ids, w, out, qlen):
        self.cpuinfer.submit(self.moe.forward_task(qlen.data_ptr(), ids.shape[1], ids.data_ptr(),
                                                   w.data_ptr(), x.data_ptr(), out.data_ptr()))
        self.cpuinfer.sync()


class OneSide:
    """kt's or kt-kernel's layer copies, built per scheme, called with the same inputs either way."""

    def __init__(self, side, threads, E, K, H, I, copies, max_len, ext=None):
        self.side, self.E, self.K, self.H, self.I = side, E, K, H, I
        self.copies, self.max_len, self.ext = copies, max_len, ext
        self.cpuinfer = ext.CPUInfer(threads) if side == "ktkernel" else None
        self.pool = CpuPool(threads) if side == "kt" else None
        self.gen = torch.Generator().manual_seed(1)
        self.layers, self.n = [], 0

    def build(self, scheme: str) -> float:
        """Fresh copies of one random layer in ``scheme`` (replacing the last ones); seconds taken."""
        t0 = time.time()
        E, H, I, gen = self.E, self.H, self.I, self.gen
        self.layers = []
        g = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
        u = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).contiguous()
        d = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16).contiguous()
        for c in range(self.copies):
            if self.side == "ktkernel":  # its own source copy too, should it read from it
                self.layers.append(KtKernelLayer(self.ext, self.cpuinfer, scheme, g.clone(), u.clone(),
                                                 d.clone(), self.K, self.max_len))
            elif c == 0:
                self.layers.append(CPUMoE.from_tensors(g, u, d, scheme=scheme, pool=self.pool))
            else:
                self.layers.append(CPUMoE(_copy(self.layers[0].w13), _copy(self.layers[0].w2), pool=self.pool))
        return time.time() - t0

    def inputs(self, g, t):
        """One call's operands, drawn from generator g: x [t, H] bf16, ids [t, K], w [t, K], out, qlen."""
        x = (torch.randn(t, self.H, generator=g) * 0.5).to(torch.bfloat16).contiguous()
        ids = torch.argsort(torch.rand(t, self.E, generator=g), dim=1)[:, :self.K].contiguous()
        w = torch.rand(t, self.K, generator=g)
        w = (w / w.sum(1, keepdim=True)).contiguous()
        return x, ids, w, torch.empty(t, self.H, dtype=torch.bfloat16), torch.tensor([t], dtype=torch.int32)

    def run(self, args) -> float:
        """One call on the next copy; its seconds."""
        layer = self.layers[self.n % len(self.layers)]
        self.n += 1
        t0 = time.perf_counter()
        if self.side == "ktkernel":
            layer(*args)
        else:
            layer(*args[:3])
        return time.perf_counter() - t0

    def calls(self, T, seed, reps) -> list[float]:
        """``reps`` timed calls at T back to back, after an untimed one-token call that wakes the
        workers; every input made first (torch ops between the calls let the workers fall asleep)."""
        g = torch.Generator().manual_seed(seed)
        args = [self.inputs(g, t) for t in [1] + [T] * reps]
        return [self.run(a) for a in args][1:]


def serve(side: OneSide):
    """Commands on stdin, one per line: ``build SCHEME`` -> ``@@built SECONDS``; ``calls T SEED N``
    -> ``@@`` and the N calls' seconds; ``idle T S`` (a call, then S seconds idle) -> the cores this
    process keeps busy meanwhile (its workers' spinning); ``quit``. It says ``@@ready`` first.
    Replies start with @@: the libraries print lines of their own."""
    print("@@ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "build":
            print(f"@@built {side.build(cmd[1]):.1f}", flush=True)
        elif cmd[0] == "idle":
            T, secs = int(cmd[1]), float(cmd[2])
            side.run(side.inputs(side.gen, T))
            c0, t0 = time.process_time(), time.perf_counter()
            time.sleep(secs)
            print(f"@@{(time.process_time() - c0) / (time.perf_counter() - t0):.3f}", flush=True)
        elif cmd[0] == "calls":
            times = side.calls(int(cmd[1]), int(cmd[2]), int(cmd[3]))
            print("@@" + " ".join(f"{t:.9f}" for t in times), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ktk", default=".ktk", help="folder with kt_kernel/ and kt_kernel.libs/")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--shape", default="128,8,2048,768", help="E,K,H,I (default qwen3-30b-a3b)")
    ap.add_argument("--T", default="1,32,512,2048")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--side", default="ktkernel", choices=["kt", "ktkernel"])
    ap.add_argument("--serve", action="store_true", help="run as a server for pair_ktkernel.py")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    t_start = time.time()
    E, K, H, I = (int(v) for v in a.shape.split(","))
    Ts = [int(t) for t in a.T.split(",") if t]
    max_len = max(512, -(-max(Ts) // 512) * 512)
    if a.serve:
        serve(OneSide(a.side, a.threads, E, K, H, I, a.copies, max_len,
                      load_ext(a.ktk) if a.side == "ktkernel" else None))
        return 0
    if a.side != "ktkernel":
        ap.error("without --serve this script times kt-kernel (--side ktkernel); bench_moe.py times kt")
    res = {"shape": dict(E=E, K=K, H=H, I=I), "threads": a.threads, "rows": [], "errors": {}}
    out_path = Path(a.out, "ktkernel.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        ext = load_ext(a.ktk)
        res["ktkernel_variant"] = getattr(ext, "__cpu_variant__", "amx")
        side = OneSide("ktkernel", a.threads, E, K, H, I, a.copies, max_len, ext)
    except Exception:
        res["errors"]["load"] = traceback.format_exc()
        out_path.write_text(json.dumps(res, indent=1))
        print(res["errors"]["load"])
        return 1
    for scheme in a.schemes.split(","):
        if time.time() - t_start > a.budget_s:
            res["errors"][scheme] = "skipped: time budget"
            continue
        try:
            print(f"{scheme}: built {a.copies} copies in {side.build(scheme):.0f} s", flush=True)
            for T in Ts:
                ts = side.calls(T, 1000 * T, a.reps + 1)[1:]
                row = dict(scheme=scheme, T=T, ktkernel_min_ms=min(ts) * 1e3,
                           ktkernel_med_ms=statistics.median(ts) * 1e3)
                res["rows"].append(row)
                print(f"{scheme} T={T:5d}: kt-kernel {row['ktkernel_min_ms']:8.3f} ms "
                      f"(median {row['ktkernel_med_ms']:8.3f})", flush=True)
                out_path.write_text(json.dumps(res, indent=1))
        except Exception:
            res["errors"][scheme] = traceback.format_exc()
            print(res["errors"][scheme], flush=True)
        out_path.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
