"""benchmarks/pair_ktkernel.py's plumbing: a real kt server (``baseline_ktkernel.py --serve --side
kt`` on a toy layer) alternated with a stand-in for kt-kernel's server that speaks the same
protocol (kt-kernel's extension itself needs the device)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pair_ktkernel as P  # noqa: E402

# answers like baseline_ktkernel.serve, with lines of its own in between (as kt-kernel prints)
FAKE = r'''
import sys
print("a library's own line", flush=True)
print("@@ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    print("12 a log line that starts with a digit", flush=True)
    if cmd[0] == "build":
        print("@@built 0.0", flush=True)
    elif cmd[0] == "idle":
        print("@@0.5", flush=True)
    elif cmd[0] == "calls":
        print("@@" + " ".join(["0.004"] * int(cmd[3])), flush=True)
'''


def test_kt_server_alternates_with_a_stand_in(tmp_path, monkeypatch):
    fake = tmp_path / "fake_ktk.py"
    fake.write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=ROOT)
    common = ["--shape", "8,2,64,32", "--T", "1,4", "--copies", "2"]
    kt = P.Side("kt", sys.executable, ["--side", "kt", "--threads", "1", *common], env)
    monkeypatch.setattr(P, "SERVER", fake)
    ktk = P.Side("kt-kernel", sys.executable, [], env)
    try:
        assert kt.ask("build int8").split()[0] == "built"
        assert ktk.ask("build int8") == "built 0.0"
        assert float(kt.ask("idle 1 0.05")) >= 0.0
        times = [float(t) for t in kt.ask("calls 4 7 3").split()]
        assert len(times) == 3 and all(0 < t < 10 for t in times)
        ps = P.pairs(kt, ktk, 4, 3, 0.0, 2, 100)
        assert len(ps) == 3 and all(a > 0 and b == 0.004 for a, b in ps)
        r = P.summarise("int8", 4, ps, 1, 1)
        assert r["pairs"] == 3 and r["ktk_min_ms"] == 4.0
        assert r["speedup_of_minima"] == round(0.004 / min(a for a, _ in ps), 3)
        assert r["speedup_pair_min"] <= r["speedup_pair_median"] <= r["speedup_pair_max"]
        res = dict(shape="8,2,64,32", threads=1, ktk_threads=1, pairs=3, gap_s=0.0, block=2, rows=[r])
        P.write_md(res, tmp_path / "p.md")
        text = (tmp_path / "p.md").read_text()
        assert "| int8 | 4 |" in text and "best of 2 calls" in text
    finally:
        kt.close()
        ktk.close()
    assert kt.proc.returncode == 0 and ktk.proc.returncode == 0
