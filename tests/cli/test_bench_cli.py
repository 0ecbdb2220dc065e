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
    assert main(["bench", "--shape", "nope"]) == 1
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--tokens", "0"]) == 1
    assert main(["bench", "--shape", "tiny", "--schemes", "fp4"]) == 1
    assert "unknown quantisation scheme" in capsys.readouterr().err
