"""kt vs kt-kernel 0.7.2 on one MoE layer, call by call: two server processes, alternated in pairs.

Why pairs of processes: these machines switch between a fast and a slow state within minutes, so
two runs minutes apart compare moments as much as code; and each library's idle workers spin for a
while after a call (kt-kernel's for ~0.1 s, kt's for 2 ms), which steals cores from the other one
in a shared process. So each side runs alone in its own process (``_ktkernel.py --serve``: its own
threads, its own cold copies of the layer) and this script alternates them: a pair is one turn of
each side on the same x and routing, ``--gap-s`` apart (so the other side's spinners have stopped),
the order flipping every pair. A turn is an untimed one-token call that wakes the workers, then
``--block`` calls back to back on the next cold copies (all inputs made before the first), of
which the fastest counts: inputs made between calls let the workers fall asleep and slowed both
sides (kt INT8 T=512 on the H200 host 5.8 -> 10.5 ms, kt-kernel 11.4 -> 19.0). The speed-up is
read per pair (the peer's time / kt's, both from the same moment) and as the ratio of minima.

``--peer kt`` pairs kt with a second kt process: the speed-up then reads the method's own spread
(about 1.0; how far from 1.0 is the noise a kt / kt-kernel figure carries on that machine); its
result goes to pair_kt_self.json.

    python benchmarks/pair_ktkernel.py --ktk .ktk --ktk-python /path/to/python3.12 \\
        --threads 2 --schemes int8,int4,bf16 --T 1,512 --pairs 12
    PYTHONPATH=. python3 benchmarks/pair_ktkernel.py --ktk .ktk --threads 16 --ktk-threads 15 \\
        --schemes int8,int4,bf16 --T 512,2048 --pairs 5 --copies 7 --gap-s 1.0   (16 cores)

kt-kernel's extension is a cp312 build: ``--ktk-python`` must be a Python 3.12 that imports torch,
numba and kt; kt's side runs with this interpreter. Writes benchmarks/results/<machine>/
pair_ktkernel.json (see _results.py) and prints the table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402

SERVER = HERE / "_ktkernel.py"


class Side:
    """One ``_ktkernel.py --serve`` process."""

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


def pairs(kt, peer, T, n, gap, block, seed0):
    """n pairs at T (after one warm-up pair): [(kt seconds, peer seconds)], each the best of a turn
    of ``block`` calls back to back (as a serving loop calls a layer)."""
    out = []
    for p in range(-1, n):
        order = (kt, peer) if p % 2 == 0 else (peer, kt)
        t = {}
        for side in order:
            t[side] = min(float(v) for v in side.ask(f"calls {T} {seed0 + p} {block}").split())
            time.sleep(gap)
        if p >= 0:
            out.append((t[kt], t[peer]))
    return out


def summarise(scheme, T, ps, threads, peer_threads):
    kt_t = [a for a, _ in ps]
    peer_t = [b for _, b in ps]
    ratios = sorted(b / a for a, b in ps)
    return dict(scheme=scheme, T=T, threads=threads, peer_threads=peer_threads, pairs=len(ps),
                kt_min_ms=round(min(kt_t) * 1e3, 3), kt_med_ms=round(statistics.median(kt_t) * 1e3, 3),
                peer_min_ms=round(min(peer_t) * 1e3, 3), peer_med_ms=round(statistics.median(peer_t) * 1e3, 3),
                speedup_of_minima=round(min(peer_t) / min(kt_t), 3),
                speedup_pair_median=round(statistics.median(ratios), 3),
                speedup_pair_min=round(ratios[0], 3), speedup_pair_max=round(ratios[-1], 3),
                raw_ms=[[round(a * 1e3, 3), round(b * 1e3, 3)] for a, b in ps])


def markdown(res) -> str:
    lines = [f"kt ({res['threads']} threads) vs {res['peer']} ({res['peer_threads']} threads), shape "
             f"{res['shape']}, {res['pairs']} alternated pairs per row (each side's best of {res['block']} "
             f"calls back to back), gap {res['gap_s']} s", "",
             f"| scheme | T | kt min / median ms | {res['peer']} min / median ms | speed-up: minima | "
             "per pair: median (min-max) |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['scheme']} | {r['T']} | {r['kt_min_ms']:.2f} / {r['kt_med_ms']:.2f} | "
                     f"{r['peer_min_ms']:.2f} / {r['peer_med_ms']:.2f} | {r['speedup_of_minima']:.2f}x | "
                     f"{r['speedup_pair_median']:.2f}x ({r['speedup_pair_min']:.2f}-"
                     f"{r['speedup_pair_max']:.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", default="ktkernel", choices=["ktkernel", "kt"],
                    help="the other side: kt-kernel, or kt itself (the method's own spread)")
    ap.add_argument("--ktk", default=".ktk", help="folder with kt_kernel/ and kt_kernel.libs/")
    ap.add_argument("--ktk-python", default=sys.executable, help="a Python 3.12 with torch, numba and kt")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="kt's threads")
    ap.add_argument("--ktk-threads", type=int, default=None, help="the peer's (default: --threads)")
    ap.add_argument("--shape", default="128,8,2048,768", help="E,K,H,I (default qwen3-30b-a3b)")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--T", default="512")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--copies", type=int, default=4, help="cold copies of the layer per side")
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--block", type=int, default=3, help="timed calls per turn (the best counts)")
    add_out_arguments(ap)
    a = ap.parse_args(argv)
    peer_threads = a.ktk_threads or a.threads
    Ts = [int(t) for t in a.T.split(",") if t]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    common = ["--shape", a.shape, "--T", ",".join(map(str, Ts)), "--copies", str(a.copies)]
    folder = out_dir(a)
    peer_name = "kt-kernel 0.7.2" if a.peer == "ktkernel" else "kt"
    name = "pair_ktkernel" if a.peer == "ktkernel" else "pair_kt_self"
    res = dict(peer=peer_name, shape=a.shape, threads=a.threads, peer_threads=peer_threads, pairs=a.pairs,
               gap_s=a.gap_s, block=a.block, rows=[])
    kt = Side("kt", sys.executable, ["--side", "kt", "--threads", str(a.threads), *common], env)
    try:
        if a.peer == "ktkernel":
            peer = Side("kt-kernel", a.ktk_python,
                        ["--side", "ktkernel", "--ktk", a.ktk, "--threads", str(peer_threads), *common], env)
        else:
            peer = Side("kt (peer)", sys.executable, ["--side", "kt", "--threads", str(peer_threads), *common], env)
    except Exception:
        kt.close()
        raise
    path = None
    try:
        for scheme in a.schemes.split(","):
            # one side at a time: both quantise with every core
            b1 = kt.ask(f"build {scheme}")
            b2 = peer.ask(f"build {scheme}")
            print(f"{scheme}: kt {b1}, {peer.name} {b2} (s)", flush=True)
            if not res.get("idle_cores"):
                # how long each side's workers keep spinning after a call (what --gap-s must cover)
                res["idle_cores"] = {s.name: {str(g): float(s.ask(f"idle {Ts[0]} {g}"))
                                              for g in (0.1, 0.5, 1.0)} for s in (kt, peer)}
                print(f"  cores busy in the seconds after a call: {res['idle_cores']}", flush=True)
            for T in Ts:
                ps = pairs(kt, peer, T, a.pairs, a.gap_s, a.block, 1000 * T)
                r = summarise(scheme, T, ps, a.threads, peer_threads)
                res["rows"].append(r)
                print(f"  T={T:5d}: kt {r['kt_min_ms']:.2f} / {r['kt_med_ms']:.2f} ms, {peer.name} "
                      f"{r['peer_min_ms']:.2f} / {r['peer_med_ms']:.2f} ms (min / median); speed-up "
                      f"{r['speedup_of_minima']:.2f}x of minima, per pair {r['speedup_pair_median']:.2f}x "
                      f"median ({r['speedup_pair_min']:.2f}-{r['speedup_pair_max']:.2f})", flush=True)
                path = write_result(folder, name, res, a.machine)
    finally:
        kt.close()
        peer.close()
    path = write_result(folder, name, res, a.machine)
    print(markdown(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
