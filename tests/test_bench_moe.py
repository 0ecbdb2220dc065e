"""benchmarks/bench_moe.py's plumbing: the bandwidth figure for the floor and the kt-kernel
baseline's subprocess (its real run needs kt-kernel's AMX extension: the device)."""
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_moe  # noqa: E402

FAKE = r'''
import argparse, json, sys
from pathlib import Path
ap = argparse.ArgumentParser()
for f in ("--ktk", "--side", "--threads", "--shape", "--T", "--schemes", "--budget-s", "--out"):
    ap.add_argument(f)
a = ap.parse_args()
if a.side != "ktkernel" or a.shape != "128,8,2048,768" or a.threads != "16":
    sys.exit("unexpected arguments: " + " ".join(sys.argv[1:]))
rows = [dict(scheme=s, T=int(t), side="ktkernel", ktkernel_min_ms=0.01 * int(t), ktkernel_med_ms=0.011 * int(t))
        for s in a.schemes.split(",") for t in a.T.split(",")]
errors = {"bf16": "Traceback ...\nRuntimeError: no BF16 here"} if "bf16" in a.schemes else {}
Path(a.out, "ktkernel_vs_kt_ktkernel.json").write_text(json.dumps(dict(rows=rows, errors=errors, ktkernel_variant="amx")))
'''


def test_floor_bandwidth_uses_the_thread_count_measured():
    bw = {"1_thread_GBps": 30.0, "2_thread_GBps": 25.0, "16_thread_GBps": 100.0}
    assert bench_moe._bw_for(bw, 1) == 30e9
    assert bench_moe._bw_for(bw, 2) == 30e9  # the better of one and two threads
    assert bench_moe._bw_for(bw, 16) == 100e9
    assert bench_moe._bw_for(bw, 8) == 30e9  # not measured: the best figure at fewer threads


def test_ktkernel_baseline_rows_notes_and_table(tmp_path):
    script = tmp_path / "fake_baseline.py"
    script.write_text(FAKE)
    kt = dict(impl="kt", shape="qwen3-30b-a3b", scheme="int8", kernels="amx", threads=16, GBps=50.0,
              TOPS=1.0, weight_MB=100.0, floor_us=1000.0)
    rows = [dict(kt, T=1, min_us=500.0, median_us=600.0, frac_of_floor=0.5),
            dict(kt, T=512, min_us=2000.0, median_us=2100.0, frac_of_floor=0.5),
            dict(kt, T=512, threads=8, min_us=2500.0, median_us=2600.0, frac_of_floor=0.4)]
    notes = []
    bench_moe.ktkernel_baseline("qwen3-30b-a3b", [1, 512], ["int8", "bf16"], 16, str(tmp_path), rows, notes,
                                script=str(script))
    ktk = {(r["scheme"], r["T"]): r for r in rows if r["impl"] == "kt-kernel"}
    assert set(ktk) == {("int8", 1), ("int8", 512), ("bf16", 1), ("bf16", 512)}
    # kt's best thread count: 2000 us at T=512 against kt-kernel's 5120 us
    assert ktk[("int8", 512)]["kt_speedup"] == 2.56 and ktk[("int8", 1)]["kt_speedup"] == 0.02
    assert ktk[("int8", 512)]["frac_of_floor"] == round(1000.0 / 5120.0, 3)
    assert ktk[("bf16", 1)]["kt_speedup"] is None  # no kt row for it
    assert any("no BF16 here" in n for n in notes)
    res = dict(host=dict(cpu="x", cpus=16, variant="amx"), bandwidth={"1_thread_GBps": 30.0, "16_thread_GBps": 100.0},
               peaks={}, pool_gb=4, rows=rows, notes=notes)
    md = tmp_path / "moe.md"
    bench_moe.write_md(res, md)
    text = md.read_text()
    assert "| kt-kernel | qwen3-30b-a3b | int8 | amx | 16 | 512 | 5.12 |" in text and "2.56x" in text
    assert "16 thread(s) 100.0 GB/s" in text


def test_ktkernel_baseline_failure_is_a_note(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import sys; sys.exit('kt_kernel extension failed to load')")
    rows, notes = [], []
    bench_moe.ktkernel_baseline("qwen3-30b-a3b", [1], ["int8"], 16, str(tmp_path), rows, notes, script=str(script))
    assert not rows and len(notes) == 1 and "exit 1" in notes[0] and "failed to load" in notes[0]


def test_find_ktkernel(tmp_path, monkeypatch):
    assert bench_moe.find_ktkernel(str(tmp_path)) == str(tmp_path)
    found = bench_moe.find_ktkernel()
    local = Path(ROOT, ".ktk", "kt_kernel")
    assert (found is not None) if local.is_dir() else (found is None or Path(found, "kt_kernel").is_dir())
