"""GGUF input: expert stacks in F32/F16/BF16, Q8_0/Q4_0 and K-quants (Q4_K/Q5_K/Q6_K).

gguf's writer cannot quantise K-quants (gguf.quants.quantize raises NotImplementedError for
them), so those tensors are random valid K-quant blocks written raw; the reference weights are
gguf's own dequantisation of the same bytes, as for every type here.
"""
from __future__ import annotations

import pytest

from kt.testing.checkpoints import gguf_file, layer_errors

from kt.weights import SourceError, convert, verify

BOUND = {"int8": 0.03, "int4": 0.25, "bf16": 0.006}  # see test_convert_hf.py for where they come from


@pytest.fixture(scope="module")
def gguf_src(tmp_path_factory):
    pytest.importorskip("gguf", reason="GGUF input needs the gguf package")
    return gguf_file(tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_gguf_convert_load_accuracy(gguf_src, tmp_path, scheme):
    path, refs = gguf_src
    out = tmp_path / "o"
    m = convert(path, out, scheme, 128, progress=False)
    assert m["layers"] == [0, 1, 2] and m["architecture"] == "qwen3moe"
    assert (m["num_experts"], m["hidden_size"], m["intermediate_size"]) == (4, 256, 256)
    assert verify(out) == []
    for L, (w13, w2) in refs.items():
        rel, diff, _ = layer_errors(out, L, w13, w2)
        assert diff == 0.0, f"layer {L}: differs from reference.quantize by {diff}"
        assert rel <= BOUND[scheme], f"layer {L} {scheme}: relative error {rel:.4f}"


def test_gguf_without_experts(tmp_path):
    gguf = pytest.importorskip("gguf", reason="GGUF input needs the gguf package")
    import numpy as np

    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_tensor("blk.0.ffn_gate.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"architecture 'llama'.*no expert tensors"):
        convert(p, tmp_path / "o", "int8", progress=False)
