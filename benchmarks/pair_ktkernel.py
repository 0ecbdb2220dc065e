"""kt vs kt-kernel 0.7.2, call by call: two server processes, their calls alternated in pairs.

The machines this runs on switch between a fast and a slow state within minutes, and each library's
idle worker threads spin for a while after a call (kt-kernel's for ~0.1 s, kt's for 2 ms), which
stole cores from the other library when both ran in one process. So each side runs alone in its
own process (``baseline_ktkernel.py --serve``: its own threads, its own cold copies of the layer),
and this script alternates them: a pair is one kt call and one kt-kernel call on the same x and
routing, ``--gap-s`` apart (so the other side's spinners have stopped), the order flipping every
pair. A side's turn is an untimed one-token call that wakes its workers, then ``--block`` calls back
to back (each on the next cold copy, with fresh routing; all inputs made before the first), of
which the fastest counts: inputs made between the calls (torch ops) let kt's workers fall asleep
before every call (``CpuPool(spin_us=...)``) and slowed both sides, kt's INT8 T=512 calls on the
device from 5.8 to 10.5 ms, kt-kernel's from 11.4 to 19.0. The speed-up is read per pair
(kt-kernel's time / kt's, both from the same moment) and as the ratio of the two sides' minima.

    python benchmarks/pair_ktkernel.py --ktk .ktk --ktk-python /tmp/py312/bin/python \\
        --threads 2 --schemes int8,int4 --T 512 --pairs 12 --out benchmarks/results/pairs_dev

kt-kernel's extension is a cp312 build: ``--ktk-python`` must be a Python 3.12 with torch (see
``baseline_ktkernel.py``); kt's side runs with this interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE / "baseline_ktkernel.py"


class Side:
    """One ``baseline_ktkernel.py --serve`` process."""

    def __init__(self, name, python, args, env):
        self.name = name
        self.proc = subprocess.Popen([python, str(SERVER), "--serve", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.expect("ready")

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self):
        while True:
            reply = self.proc.stdout.readline()
            if not reply:
                raise RuntimeError(f"the {self.name} server exited (code {self.proc.poll()}); "
                                   "see its stderr above")
            # the libraries print lines of their own (kt-kernel logs to stdout): replies start with @@
            if reply.startswith("@@"):
                return reply[2:].strip()

    def expect(self, word):
        reply = self.read()
        if reply.split()[0] != word:
            raise RuntimeError(f"the {self.name} server said {reply!r}, expected {word!r}")
        return reply

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


def pairs(kt, ktk, T, n, gap, block, seed0):
    """n pairs at T (after one warm-up pair): [(kt seconds, kt-kernel seconds)], each the best of
    a turn of ``block`` calls back to back (as a serving loop calls a layer)."""
    out = []
    for p in range(-1, n):
        order = (kt, ktk) if p % 2 == 0 else (ktk, kt)
        t = {}
        for side in order:
            t[side.name] = min(float(v) for v in side.ask(f"calls {T} {seed0 + p} {block}").split())
            time.sleep(gap)
        if p >= 0:
            out.append((t["kt"], t["kt-kernel"]))
    return out


def summarise(scheme, T, ps, threads, ktk_threads):
    kt_t = [a for a, _ in ps]
    ktk_t = [b for _, b in ps]
    ratios = sorted(b / a for a, b in ps)
    return dict(scheme=scheme, T=T, threads=threads, ktk_threads=ktk_threads, pairs=len(ps),
                kt_min_ms=round(min(kt_t) * 1e3, 3), kt_med_ms=round(statistics.median(kt_t) * 1e3, 3),
                ktk_min_ms=round(min(ktk_t) * 1e3, 3), ktk_med_ms=round(statistics.median(ktk_t) * 1e3, 3),
                speedup_of_minima=round(min(ktk_t) / min(kt_t), 3),
                speedup_pair_median=round(statistics.median(ratios), 3),
                speedup_pair_min=round(ratios[0], 3), speedup_pair_max=round(ratios[-1], 3),
                raw_ms=[[round(a * 1e3, 3), round(b * 1e3, 3)] for a, b in ps])


def write_md(res, path):
    lines = ["| scheme | T | kt min / median ms | kt-kernel min / median ms | speed-up: minima | "
             "per pair: median (min-max) |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['scheme']} | {r['T']} | {r['kt_min_ms']:.2f} / {r['kt_med_ms']:.2f} | "
                     f"{r['ktk_min_ms']:.2f} / {r['ktk_med_ms']:.2f} | {r['speedup_of_minima']:.2f}x | "
                     f"{r['speedup_pair_median']:.2f}x ({r['speedup_pair_min']:.2f}-"
                     f"{r['speedup_pair_max']:.2f}) |")
    head = (f"kt ({res['threads']} threads) vs kt-kernel 0.7.2 ({res['ktk_threads']} threads), "
            f"shape {res['shape']}, {res['pairs']} alternated pairs per row (each side's best of "
            f"{res['block']} calls back to back), gap {res['gap_s']} s\n\n")
    path.write_text(head + "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ktk", default=".ktk", help="folder with kt_kernel/ and kt_kernel.libs/")
    ap.add_argument("--ktk-python", default=sys.executable, help="a Python 3.12 with torch")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="kt's threads")
    ap.add_argument("--ktk-threads", type=int, default=None, help="kt-kernel's (default: --threads)")
    ap.add_argument("--shape", default="128,8,2048,768", help="E,K,H,I (qwen3-30b-a3b)")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--T", default="512")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--copies", type=int, default=4, help="cold copies of the layer per side")
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--block", type=int, default=3, help="timed calls per turn (the best counts)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    ktk_threads = a.ktk_threads or a.threads
    Ts = [int(t) for t in a.T.split(",") if t]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    common = ["--shape", a.shape, "--T", ",".join(map(str, Ts)), "--copies", str(a.copies)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(shape=a.shape, threads=a.threads, ktk_threads=ktk_threads, pairs=a.pairs, gap_s=a.gap_s,
               block=a.block, rows=[])
    kt = Side("kt", sys.executable, ["--side", "kt", "--threads", str(a.threads), *common], env)
    ktk = Side("kt-kernel", a.ktk_python,
               ["--side", "ktkernel", "--ktk", a.ktk, "--threads", str(ktk_threads), *common], env)
    try:
        for scheme in a.schemes.split(","):
            # one side at a time: both quantise with every core
            b1 = kt.ask(f"build {scheme}")
            b2 = ktk.ask(f"build {scheme}")
            print(f"{scheme}: kt {b1}, kt-kernel {b2} (s)", flush=True)
            if not res.get("idle_cores"):
                # how long each side's workers keep spinning after a call (what --gap-s must cover)
                res["idle_cores"] = {s.name: {str(g): float(s.ask(f"idle {Ts[0]} {g}"))
                                              for g in (0.1, 0.5, 1.0)} for s in (kt, ktk)}
                print(f"  cores busy in the seconds after a call: {res['idle_cores']}", flush=True)
            for T in Ts:
                ps = pairs(kt, ktk, T, a.pairs, a.gap_s, a.block, 1000 * T)
                r = summarise(scheme, T, ps, a.threads, ktk_threads)
                res["rows"].append(r)
                print(f"  T={T:5d}: kt {r['kt_min_ms']:.2f} / {r['kt_med_ms']:.2f} ms, kt-kernel "
                      f"{r['ktk_min_ms']:.2f} / {r['ktk_med_ms']:.2f} ms (min / median); speed-up "
                      f"{r['speedup_of_minima']:.2f}x of minima, per pair {r['speedup_pair_median']:.2f}x "
                      f"median ({r['speedup_pair_min']:.2f}-{r['speedup_pair_max']:.2f})", flush=True)
                (out / "pair_ktkernel.json").write_text(json.dumps(res, indent=1))
    finally:
        kt.close()
        ktk.close()
    (out / "pair_ktkernel.json").write_text(json.dumps(res, indent=1))
    write_md(res, out / "pair_ktkernel.md")
    print(f"wrote {out / 'pair_ktkernel.json'}")


if __name__ == "__main__":
    main()
