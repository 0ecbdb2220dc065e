"""kt's own safetensors reader/writer: aligned, zero-copy views, interoperable, atomic."""
from __future__ import annotations

import numpy as np
import pytest

from kt.weights._safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors


def _write(path, arrays, meta=None):
    specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}

    def fill(sink):
        for k, v in arrays.items():
            if k == "b":  # one tensor through pwrite, in two pieces
                half = v.nbytes // 2
                sink.pwrite(k, half, v.reshape(-1).view(np.uint8)[half:])
                sink.pwrite(k, 0, v.reshape(-1).view(np.uint8)[:half])
            else:
                sink.arrays[k][...] = v

    write_safetensors(path, specs, fill, meta)


def test_roundtrip_aligned_and_interoperable(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.integers(-128, 127, (3, 64), dtype=np.int8),
              "b": rng.standard_normal((5, 16)).astype(np.float32),
              "c": np.zeros((2, 0), np.int32),
              "d": rng.integers(0, 65535, (4, 32), dtype=np.uint16)}
    p = tmp_path / "x.safetensors"
    _write(p, arrays, {"k": "v"})
    f = SafetensorsFile(p)
    assert f.metadata == {"k": "v"}
    assert f.data_start % 64 == 0
    for k, v in arrays.items():
        got = f.get(k)
        np.testing.assert_array_equal(got, v)
        if v.size:
            assert isinstance(got.base, np.memmap) and got.ctypes.data % 64 == 0
    from safetensors.numpy import load_file

    theirs = load_file(p)
    for k, v in arrays.items():
        np.testing.assert_array_equal(theirs[k], v)
    assert not list(tmp_path.glob(".*tmp*")), "temp file left behind"


def test_failed_write_leaves_nothing(tmp_path):
    p = tmp_path / "x.safetensors"

    def boom(sink):
        sink.arrays["a"][0] = 1
        raise RuntimeError("fail in fill")

    with pytest.raises(RuntimeError, match="fail in fill"):
        write_safetensors(p, {"a": ((64,), np.dtype(np.int8))}, boom)
    assert list(tmp_path.iterdir()) == []

    def overrun(sink):
        sink.pwrite("a", 60, np.zeros(8, np.uint8))

    with pytest.raises(ValueError, match="overruns tensor 'a'"):
        write_safetensors(p, {"a": ((64,), np.dtype(np.int8))}, overrun)
    assert list(tmp_path.iterdir()) == []


def test_bad_files(tmp_path):
    p = tmp_path / "x.safetensors"
    _write(p, {"a": np.ones((16, 16), np.float32)})
    raw = p.read_bytes()
    p.write_bytes(raw[:-10])
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(p)
    p.write_bytes(raw[:5])
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(p)
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not json}      " + b"0" * 64)
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        SafetensorsFile(p)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        SafetensorsFile(tmp_path / "nope.safetensors")


def test_xxh64_matches_libxxhash_and_known_vectors():
    from kt.weights._hash_kernels import xxh64

    assert int(xxh64(np.frombuffer(b"", np.uint8))) == 0xEF46DB3751D8E999
    assert int(xxh64(np.frombuffer(b"Nobody inspects the spammish repetition", np.uint8))) == 0xFBCEA83C8A378BF1
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("xxhash")
    if name is None:
        pytest.skip("libxxhash not installed: only the published test vectors were checked")
    lib = ctypes.CDLL(name)
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    rng = np.random.default_rng(0)
    for n in [*range(0, 70), 1000, 4099, 1 << 16]:
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert int(xxh64(a)) == lib.XXH64(a.ctypes.data, n, 0), n


def test_checksum_algorithms(tmp_path):
    from kt.weights._format import WeightFormatError, file_checksum

    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 300)
    a = file_checksum(p)
    assert a.startswith("xxh64x16MiB-sha256:") and a == file_checksum(p, threads=1)
    c = file_checksum(p, algorithm="crc32x16MiB-sha256")
    raw = bytearray(p.read_bytes())
    raw[12345] ^= 4
    p.write_bytes(bytes(raw))
    assert file_checksum(p) != a and file_checksum(p, algorithm="crc32x16MiB-sha256") != c
    with pytest.raises(WeightFormatError, match="unknown checksum algorithm 'md5'"):
        file_checksum(p, algorithm="md5")
