"""kt.hf.load_model: the model built on the meta device, kt experts in place, then only the
non-expert tensors read. Equal to the old path (from_pretrained then patch_model) on every
family, never reading an expert tensor of the checkpoint with a kt weight directory, FP8
block-scaled checkpoints, and the clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from _hf_models import require_kt_backend  # noqa: F401  (sets the transformers skip)

from kt.hf import FAMILIES, PatchConfig, patch_model
from kt.hf.accuracy import random_prompts
from kt.hf.run import load_model
from kt.hf.tiny import save_tiny_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    return {f: save_tiny_model(root / f, f, seed=0) for f in sorted(FAMILIES)}


def _old_path(model_dir, dtype, device=None, **patch):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], local_files_only=True).eval()
    return patch_model(m, PatchConfig(**patch), progress=False, device=device)


def _logits(model, seed=0, length=12):
    ids = random_prompts(model.config.vocab_size, n=1, length=length, seed=seed)[0]
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_equals_the_old_path(ckpts, family, dtype):
    """Same weights, same packing (the converter's kernels quantise as CPUMoE.from_tensors
    does), same model code: the logits are bitwise equal, for every scheme."""
    require_kt_backend()
    for scheme in ("bf16", "int8", "int4"):
        new, _ = load_model(ckpts[family], PatchConfig(scheme=scheme), device="cpu", dtype=dtype,
                            progress=False)
        old = _old_path(ckpts[family], dtype, scheme=scheme)
        assert new.kt_load.experts_from == "checkpoint"
        assert new.kt_patch.layers == old.kt_patch.layers
        old_w = dict(old.named_parameters())
        for name, p in new.named_parameters():
            assert p.dtype == old_w[name].dtype and torch.equal(p, old_w[name]), name
        torch.testing.assert_close(_logits(new), _logits(old), rtol=0, atol=0,
                                   msg=f"{family} {dtype} {scheme}")


def test_reference_backend(ckpts):
    """backend="reference" gets the layer's dense weights from the converter's reader."""
    for family in ("olmoe", "mixtral"):
        with pytest.warns(UserWarning, match="reference"):
            new, _ = load_model(ckpts[family], PatchConfig(scheme="int4", backend="reference"),
                                device="cpu", dtype="fp32", progress=False)
        with pytest.warns(UserWarning, match="reference"):
            old = _old_path(ckpts[family], "fp32", scheme="int4", backend="reference")
        assert new.kt_patch.backend == "reference"
        torch.testing.assert_close(_logits(new, length=6), _logits(old, length=6), rtol=0, atol=0)


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: the checkpoint holds one matrix; the loaded model shares it."""
    require_kt_backend()
    d = save_tiny_model(tmp_path / "tied", "qwen3_moe", tie_word_embeddings=True)
    new, _ = load_model(d, PatchConfig(scheme="int8"), device="cpu", dtype="fp32", progress=False)
    assert new.lm_head.weight is new.model.embed_tokens.weight
    torch.testing.assert_close(_logits(new), _logits(_old_path(d, "fp32", scheme="int8")), rtol=0, atol=0)


def test_fused_checkpoint(ckpts, tmp_path):
    """A checkpoint holding transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) instead of per-expert tensors loads to the same model."""
    require_kt_backend()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = ckpts["qwen3_moe"]
    d = tmp_path / "fused"
    shutil.copytree(src, d)
    (d / "model.safetensors").unlink()
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, local_files_only=True)
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(d / "model.safetensors"))
    new, _ = load_model(d, PatchConfig(scheme="int8"), device="cpu", dtype="bf16", progress=False)
    torch.testing.assert_close(_logits(new), _logits(_old_path(src, "bf16", scheme="int8")), rtol=0, atol=0)


# ----------------------------------------------------------------------------- no expert read

class _ReadLog:
    """Every tensor of ``root``'s safetensors files that anything read, by name: kt.hf's pread
    (mapped back to tensor names through the headers), kt.weights' SafetensorsFile.get, and the
    safetensors package's own readers."""

    def __init__(self, monkeypatch, root):
        import safetensors
        import safetensors.torch

        from kt.hf import _checkpoint
        from kt.weights._safetensors_io import SafetensorsFile, read_header

        self.names: list[str] = []
        root = root.resolve()
        spans = {}
        for f in root.glob("*.safetensors"):
            header, _, start, _ = read_header(f)
            spans[f] = [(start + b0, start + b1, n) for n, info in header.items() if n != "__metadata__"
                        for b0, b1 in [info["data_offsets"]]]
        real_pread, real_get = _checkpoint.pread_into, SafetensorsFile.get

        def pread(path, offset, buf):
            for b0, b1, n in spans.get(path.resolve(), []):
                if b0 < offset + buf.nbytes and offset < b1:
                    self.names.append(n)
            return real_pread(path, offset, buf)

        def get(sf, name):
            if sf.path.resolve().parent == root:
                self.names.append(name)
            return real_get(sf, name)

        def forbidden(*a, **k):
            raise AssertionError(f"the loader called the safetensors package ({a[:1]})")

        monkeypatch.setattr(_checkpoint, "pread_into", pread)
        monkeypatch.setattr(SafetensorsFile, "get", get)
        monkeypatch.setattr(safetensors, "safe_open", forbidden)
        monkeypatch.setattr(safetensors.torch, "load_file", forbidden)


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and ".shared_expert" not in name


def test_kt_weight_dir_reads_no_expert_tensor(ckpts, tmp_path, monkeypatch):
    """With a kt weight directory, every non-expert tensor of the checkpoint is read once and
    no routed-expert tensor at all; the result equals the old path with the same directory."""
    require_kt_backend()
    import kt.weights
    from kt.weights._safetensors_io import read_header

    src = ckpts["deepseek_v3"]
    w8 = tmp_path / "kt-int8"
    kt.weights.convert(src, w8, scheme="int8", progress=False)
    log = _ReadLog(monkeypatch, src)
    new, _ = load_model(src, PatchConfig(scheme="int8", weight_path=w8), device="cpu", dtype="fp32",
                        progress=False)
    monkeypatch.undo()
    header, _, _, _ = read_header(src / "model.safetensors")
    names = [n for n in header if n != "__metadata__"]
    experts = {n for n in names if _is_routed_expert(n)}
    assert len(experts) == 2 * 16 * 3  # the guard knows what to look for
    assert not experts & set(log.names), sorted(experts & set(log.names))[:5]
    assert sorted(log.names) == sorted(set(names) - experts), "each non-expert tensor read once"
    assert new.kt_load.experts_from == "kt weight directory"
    assert sorted(new.kt_load.tensors_read) == sorted(log.names)
    old = _old_path(src, "fp32", scheme="int8", weight_path=w8)
    torch.testing.assert_close(_logits(new), _logits(old), rtol=0, atol=0)


def test_checkpoint_path_reads_each_expert_tensor_once_through_the_converter(ckpts, monkeypatch):
    """Without a kt directory the experts come from the converter's reader, layer by layer;
    the loader's own reads stay on the non-expert tensors."""
    require_kt_backend()
    from kt.hf import _checkpoint

    src = ckpts["qwen3_moe"]
    preads = []
    real = _checkpoint.pread_into
    monkeypatch.setattr(_checkpoint, "pread_into", lambda p, o, b: (preads.append(o), real(p, o, b))[1])
    m, _ = load_model(src, PatchConfig(scheme="int8"), device="cpu", dtype="bf16", progress=False)
    assert not any(_is_routed_expert(n) for n in m.kt_load.tensors_read)
    assert len(preads) == len(m.kt_load.tensors_read)


# ----------------------------------------------------------------------------- FP8

def _fp8_checkpoint(src, out, block=(16, 32)):
    """DeepSeek-V3 style: every 2-D projection weight (attention, dense and shared MLPs, routed
    experts) stored e4m3 with ``weight_scale_inv`` block scales; embeddings, norms, routers in
    the source dtype. Returns (the fp8 directory, a directory holding the dequantised values in
    fp32, the reference)."""
    from safetensors.torch import load_file, save_file

    bn, bd = block
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        proj = name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")
        if t.ndim != 2 or not proj:
            fp8[name] = deq[name] = t
            continue
        n, d = t.shape
        w = t.float()
        nb, db = -(-n // bn), -(-d // bd)
        amax = torch.zeros(nb, db)
        for i in range(nb):
            for j in range(db):
                amax[i, j] = w[i * bn:(i + 1) * bn, j * bd:(j + 1) * bd].abs().max()
        s = (amax / 448.0).clamp_min(1e-12) * (1 + 0.1 * torch.rand(nb, db, generator=gen))
        sfull = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bd, 1)[:, :d]
        q = (w / sfull).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, s
        deq[name] = q.float() * sfull
    dirs = []
    for sub, tens, quant in (("fp8", fp8, True), ("deq", deq, False)):
        d = out / sub
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
        save_file(tens, str(d / "model.safetensors"))
        if quant:
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic", "weight_block_size": [bn, bd]}
            (d / "config.json").write_text(json.dumps(cfg))
        dirs.append(d)
    return dirs[0], dirs[1], deq


def test_fp8_block_scaled_checkpoint(tmp_path):
    """Non-expert weights dequantised as they are read equal the dequantised reference exactly
    (fp32 model); the experts go through kt's FP8 converter; logits equal the old path on the
    dequantised checkpoint."""
    require_kt_backend()
    src = save_tiny_model(tmp_path / "src", "deepseek_v3", seed=0)
    fp8_dir, deq_dir, deq = _fp8_checkpoint(src, tmp_path)
    new, _ = load_model(fp8_dir, PatchConfig(scheme="int8"), device="cpu", dtype="fp32", progress=False)
    assert getattr(new.config, "quantization_config", None) is None
    q = new.model.layers[1].self_attn.kv_a_proj_with_mqa.weight  # [48, 128]: ragged 16x32 blocks
    assert torch.equal(q, deq["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    assert any(n.endswith("_scale_inv") for n in new.kt_load.tensors_read)
    old = _old_path(deq_dir, "fp32", scheme="int8")
    torch.testing.assert_close(_logits(new), _logits(old), rtol=0, atol=0)
    # the loaded bf16 weights themselves (dense_scheme "torch": kept as nn.Linear weights)
    bf, _ = load_model(fp8_dir, PatchConfig(scheme="int8", dense_scheme="torch"), device="cpu",
                       dtype="bf16", progress=False)
    assert bf.model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(bf.model.layers[1].self_attn.o_proj.weight,
                               deq["model.layers.1.self_attn.o_proj.weight"].bfloat16(), rtol=0, atol=0)


def test_fp8_without_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from kt.weights import SourceError

    src = save_tiny_model(tmp_path / "src", "deepseek_v3", seed=0)
    fp8_dir, _, _ = _fp8_checkpoint(src, tmp_path)
    t = load_file(str(fp8_dir / "model.safetensors"))
    del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(t, str(fp8_dir / "model.safetensors"))
    with pytest.raises(SourceError, match=r"o_proj\.weight' is fp8 e4m3 but .*weight_scale_inv"):
        load_model(fp8_dir, PatchConfig(scheme="int8"), device="cpu", progress=False)


# ----------------------------------------------------------------------------- errors

def _rewrite(model_dir, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(model_dir / "model.safetensors"))
    edit(t)
    save_file(t, str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("case, match", [
    ("missing", r"no tensor for 1 of the model's weights, e\.g\. \['model\.norm\.weight'\]"),
    ("shape", r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.o_proj\.weight' has shape "
              r"\[128, 64\], but the model \(config\.json\) expects \[128, 128\]"),
    ("truncated", r"model\.safetensors: truncated"),
    ("no_experts", r"no routed-expert tensors for layers \[1\]"),
    ("dtype", r"tensor 'model\.norm\.weight' has dtype F8_E5M2"),
])
def test_bad_checkpoint_is_a_clear_error(ckpts, tmp_path, case, match):
    from kt.weights import SourceError

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen3_moe"], d)
    if case == "missing":
        _rewrite(d, lambda t: t.pop("model.norm.weight"))
    elif case == "shape":
        _rewrite(d, lambda t: t.update({"model.layers.1.self_attn.o_proj.weight": torch.zeros(128, 64)}))
    elif case == "truncated":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])
    elif case == "no_experts":
        _rewrite(d, lambda t: [t.pop(k) for k in list(t) if "layers.1.mlp.experts." in k])
    elif case == "dtype":
        _rewrite(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e5m2)}))
    with pytest.raises(SourceError, match=match):
        load_model(d, PatchConfig(scheme="int8"), device="cpu", progress=False)


@pytest.mark.parametrize("case, match", [
    ("other_family", "converted from a 'mixtral' model, but this model is 'qwen3_moe'"),
    ("other_shape", r"experts are \(E, H, I\) = \(8, 128, 64\), but this model has \(16, 128, 64\)"),
    ("other_config", r"whose config\.json differs from this model's"),
    ("other_files", r"whose safetensors files differ from this checkpoint's \(model\.safetensors: \d+ "
                    r"bytes there, \d+ here\)"),
    ("scheme", "converted with scheme int8, but PatchConfig asks for int4"),
])
def test_kt_weight_dir_of_another_model_is_refused(ckpts, tmp_path, case, match):
    """Refused from the manifest alone, before any layer is built or any weight read."""
    import kt.weights
    from kt.weights import WeightFormatError

    model, scheme = ckpts["qwen3_moe"], "int8"
    if case == "other_family":
        src = ckpts["mixtral"]
    elif case == "other_shape":
        src = save_tiny_model(tmp_path / "e8", "qwen3_moe", num_experts=8)
    elif case == "other_config":  # same experts' shape, another vocabulary
        src = save_tiny_model(tmp_path / "v", "qwen3_moe", vocab_size=400)
    elif case == "other_files":  # same config.json, other safetensors files
        from safetensors.torch import load_file, save_file

        src = tmp_path / "copy"
        shutil.copytree(model, src)
        t = load_file(str(src / "model.safetensors"))
        save_file(t, str(src / "model.safetensors"), metadata={"note": "x" * 200})
    else:
        src, scheme = model, "int4"
    w = tmp_path / "kt"
    kt.weights.convert(src, w, scheme="int8", progress=False)
    with pytest.raises(WeightFormatError, match=match):
        load_model(model, PatchConfig(scheme=scheme, weight_path=w), device="cpu", progress=False)


def test_patch_model_refuses_a_meta_model(ckpts):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kt.hf._loader import params_on_meta

    with params_on_meta():
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpts["olmoe"]))
    with pytest.raises(ValueError, match="holds no weights.*kt.hf.load_model"):
        patch_model(m, PatchConfig(scheme="int8"), progress=False)


# ----------------------------------------------------------------------------- progress, device

def test_progress_bars_and_silence(ckpts, capsys):
    require_kt_backend()
    load_model(ckpts["mixtral"], PatchConfig(scheme="int8"), device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "kt: experts -> int8" in err and "kt: weights -> cpu" in err
    load_model(ckpts["mixtral"], PatchConfig(scheme="int8"), device="cpu", progress=False)
    captured = capsys.readouterr()
    assert "kt:" not in captured.err + captured.out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_non_expert_weights_go_straight_to_the_gpu(ckpts):
    require_kt_backend()
    new, _ = load_model(ckpts["deepseek_v3"], PatchConfig(scheme="int8"), device="cuda", dtype="bf16",
                        progress=False)
    assert {p.device.type for p in new.parameters()} == {"cuda"}
    assert {b.device.type for b in new.buffers()} == {"cuda"}
    old = _old_path(ckpts["deepseek_v3"], "bf16", scheme="int8", device="cuda").cuda()
    ids = random_prompts(new.config.vocab_size, n=1, length=12, seed=0)[0].cuda()
    with torch.no_grad():
        torch.testing.assert_close(new(ids).logits, old(ids).logits, rtol=0, atol=0)
