import json

from kt.cli.main import main
from kt.cli import doctor


def test_doctor_text(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for section in ("CPU", "ISA flags", "AMX permission", "variant", "NUMA node 0", "Packages",
                    "numba", "GPU", "Kernel cache", "Verdict", "cpu_experts", "gpu_experts",
                    "sglang_plugin"):
        assert section in out, section
    # one line per scheme: the kernels the registry picked on this host
    for scheme in ("int8", "int4", "bf16"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  {scheme} kernels "))
        assert "decode " in line and "prefill " in line and "gemv up to" in line, line


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    import kt

    assert info["cpu"]["variant"] == kt.cpu_variant()
    assert info["cpu"]["variant"] in info["cpu"]["runnable_variants"]
    assert set(info["packages"]) >= {"torch", "numba", "llvmlite", "triton", "cupy",
                                     "transformers", "sglang"}
    assert info["memory"]["total_bytes"] > 0
    assert info["numa"] and info["numa"][0]["cpus"]
    assert info["verdict"]["cpu_experts"].startswith("yes")
    from kt.cpu_ops import registry

    assert info["cpu"]["kernels"] == {s: registry.kernel_set(s).describe() for s in ("int8", "int4", "bf16")}
    assert "gpu" in info and isinstance(info["gpu"]["gpus"], list)


def test_doctor_names_the_gpu_launch_table(capsys, monkeypatch, tmp_path):
    assert main(["doctor", "--json"]) == 0
    src = json.loads(capsys.readouterr().out)["gpu"]["launch_table"]
    assert src.startswith(("packaged", "none")), src  # no KT_GPU_TABLE here
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"H64_I32_bf16": {"16": {"block_m": 16}}}))
    monkeypatch.setenv("KT_GPU_TABLE", str(table))
    assert main(["doctor"]) == 0
    assert f"launch table   KT_GPU_TABLE={table}" in capsys.readouterr().out
    table.write_text(json.dumps({"H64_I32_bf16": {"16": {"block_m": 24}}}))
    assert main(["doctor", "--json"]) == 0
    src = json.loads(capsys.readouterr().out)["gpu"]["launch_table"]
    assert src.startswith("ERROR") and "block_m must be a power of two" in src, src


def test_doctor_reports_a_bad_forced_variant(capsys, monkeypatch):
    monkeypatch.setenv("KT_CPU_VARIANT", "nonsense")
    assert main(["doctor", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["verdict"]["cpu_experts"].startswith("NO")


def test_numa_parsing(tmp_path):
    for n, cpus in ((0, "0-3,8"), (1, "4-7")):
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       1048576 kB\n")
    nodes = doctor.numa_nodes(str(tmp_path))
    assert [x["cpus"] for x in nodes] == [[0, 1, 2, 3, 8], [4, 5, 6, 7]]
    assert nodes[0]["mem_total"] == 2**30
