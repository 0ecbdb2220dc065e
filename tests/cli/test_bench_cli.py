from kt.cli.main import main


def test_bench_tiny(capsys):
    assert main(["bench", "--shape", "tiny", "--tokens", "1,4", "--schemes", "int8,int8x2",
                 "--reps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for scheme in ("int8", "int8x2"):
        rows = [line.split() for line in out.splitlines() if line.startswith(scheme + " ")]
        assert [r[1] for r in rows] == ["1", "4"], out
        assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows)


def test_bench_bad_input(capsys):
    assert main(["bench", "--shape", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--tokens", "0"]) == 2
    assert main(["bench", "--shape", "tiny", "--schemes", "fp4"]) == 2
    assert "unknown quantisation scheme" in capsys.readouterr().err


def test_bench_profile(capsys):
    assert main(["bench", "--shape", "tiny", "--tokens", "64", "--schemes", "int8", "--reps", "2",
                 "--threads", "1", "--profile"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "phases over 1 threads" in ln)
    shares = {p.split()[0]: float(p.split()[1].rstrip("%")) for p in line.split(": ", 1)[1].split(", ")}
    assert {"gate_up", "down"} <= set(shares) and abs(sum(shares.values()) - 100) <= len(shares)
