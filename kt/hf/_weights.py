"""Loading a model's experts from a kt weight directory, checked against the model first."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .. import reference
from ..config import QuantScheme

__all__ = ["WeightDirLoader"]

# Largest relative error ||dequant(kt) - model|| / ||model|| of one expert's weights that still
# means "the same weights, quantised": the schemes' own error on real or random weights is
# about 0.3 % (bf16), 1 % (int8) and 10-12 % (int4); unrelated weights give ~141 %.
_SAME_WEIGHTS_RTOL = {QuantScheme.BF16: 0.01, QuantScheme.INT8: 0.05, QuantScheme.INT4: 0.3}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class WeightDirLoader:
    """A kt weight directory, validated against the model before any layer is patched.

    Checks the manifest's model_type, E/H/I, layers, scheme and G against the model and the
    PatchConfig, and the source checkpoint's identity: its config.json (when ``model_dir`` has
    one) and, for ``check_files``, the names and sizes of its safetensors files. With
    ``gate_up_of(layer)`` (the model's own gate_up_proj [E, 2I, H]) it also checks that two
    experts' dequantised weights match the model's, so a directory converted from another
    checkpoint of the same shape is refused too; ``load_model`` has no expert weights to compare
    with (it never reads them) and relies on the identity checks. Mismatches raise
    WeightFormatError naming the manifest.
    """

    def __init__(self, path, config, layers, *, model_type: str | None, num_experts: int,
                 hidden: int, intermediate: int, model_dir=None, gate_up_of=None,
                 check_files: dict[str, int] | None = None):
        from ..weights._format import WeightFormatError, read_manifest

        self.path = Path(path)
        self.config = config
        m = read_manifest(self.path)
        self.manifest = m
        where = self.path / "manifest.json"

        def fail(msg):
            raise WeightFormatError(f"{where}: {msg}")

        if m.get("model_type") not in (None, model_type):
            fail(f"converted from a {m['model_type']!r} model, but this model is {model_type!r}")
        got = (m["num_experts"], m["hidden_size"], m["intermediate_size"])
        if got != (num_experts, hidden, intermediate):
            fail(f"experts are (E, H, I) = {got}, but this model has {(num_experts, hidden, intermediate)}: "
                 "the directory was converted from another model")
        scheme = QuantScheme.parse(m["scheme"])
        if scheme is not config.scheme:
            fail(f"was converted with scheme {scheme.value}, but PatchConfig asks for "
                 f"{config.scheme.value}: pass scheme={scheme.value!r} or convert again with "
                 f"`kt convert --scheme {config.scheme.value}`")
        if scheme is QuantScheme.INT4 and int(m["group_size"]) != config.group_size:
            fail(f"was converted with INT4 group size {m['group_size']}, but PatchConfig asks for "
                 f"{config.group_size}")
        missing = [L for L in layers if str(L) not in m["files"]]
        if missing:
            fail(f"has no experts for layers {missing} of this model (it holds {m['layers']})")
        src = m.get("source") or {}
        own = Path(str(model_dir or "")) / "config.json"
        if model_dir and src.get("config_sha256") and own.is_file() \
                and _sha256(own) != src["config_sha256"]:
            fail(f"was converted from {src.get('path')}, whose config.json differs from this "
                 f"model's ({own})")
        if check_files is not None and src.get("kind") == "hf" and src.get("files"):
            theirs = {f["name"]: int(f["bytes"]) for f in src["files"]}
            for name in sorted(set(theirs) | set(check_files)):
                if theirs.get(name) != check_files.get(name):
                    fail(f"was converted from {src.get('path')}, whose safetensors files differ from "
                         f"this checkpoint's ({name}: {theirs.get(name)} bytes there, "
                         f"{check_files.get(name)} here): convert this checkpoint with `kt convert`")
        self.layers = list(layers)
        if gate_up_of is not None:
            self._check_content(gate_up_of(layers[0]), layers[0])

    def _load(self, layer):
        from ..weights import load_experts

        return load_experts(self.path, layer, scheme=self.config.scheme,
                            group_size=self.config.group_size, verify=False)

    def _check_content(self, gate_up, layer):
        from ..cpu_ops.packing import unpack
        from ..weights._format import WeightFormatError

        le = self._load(layer)
        for e in sorted({0, le.num_experts - 1}):
            got = reference.dequantize(unpack(le.w13.expert(e)))
            want = reference.to_numpy_f32(gate_up[e])
            err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
            if err > _SAME_WEIGHTS_RTOL[self.config.scheme]:
                raise WeightFormatError(
                    f"{self.path}: layer {layer} expert {e} differs from this model's weights by "
                    f"{100 * err:.0f}% (a {self.config.scheme.value} conversion of the same weights "
                    f"differs by < {100 * _SAME_WEIGHTS_RTOL[self.config.scheme]:.0f}%): the directory "
                    "was converted from another model")

    def cpu_moe(self, cpu_cls, layer: int, pool):
        le = self._load(layer)
        return cpu_cls(le.w13, le.w2, pool=pool)

    def dequantized(self, layer: int):
        """gate, up [E, I, H] and down [E, H, I] fp32: the values the directory stands for."""
        from ..cpu_ops.packing import unpack

        le = self._load(layer)
        w13 = np.stack([reference.dequantize(unpack(le.w13.expert(e))) for e in range(le.num_experts)])
        w2 = np.stack([reference.dequantize(unpack(le.w2.expert(e))) for e in range(le.num_experts)])
        i = le.inter
        return w13[:, :i], w13[:, i:], w2
