"""A model run on the CPU with its dense part on kt: KTLinear in place of the dense nn.Linear
modules, kt's decode attention, and the choice of dense_scheme.

Tolerances: the op-level arithmetic of KTLinear is tested against kt.reference in
tests/cpu_ops/test_dense.py. Here, whole-model logits of a bf16 model with kt's BF16 dense
linears against torch's: both multiply the same bf16 operands with fp32 accumulation, so they
differ by bf16 roundings of intermediate activations (~2^-8 relative per rounding, a few
layers deep): atol 0.05 on logits of std ~2. INT8 dense linears add the int8 rounding of
activations and weights (~1 % relative per linear): top-1 agreement >= 90 % and a relative
logit error below 10 %.
"""
import numpy as np
import pytest
import torch

from _hf_models import require_kt_backend, tiny_model

from kt.config import QuantScheme
from kt.hf import PatchConfig, patch_model
from kt.hf._attention import NAME, cpu_decode_attention
from kt.hf._dense import KTLinear, dense_scheme_for


def _sdpa(*args, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kw)


class _Attn(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_decode_attention_matches_sdpa(dtype, mask):
    g = torch.Generator().manual_seed(hash((str(dtype), str(mask))) % 2**31)
    B, Hkv, G, S, D = 2, 2, 4, 13, 16
    q = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    m = None
    if mask is not None:
        keep = torch.rand(B, 1, 1, S, generator=g) > 0.3
        keep[..., -1] = True
        m = keep if mask == "bool" else torch.where(keep, 0.0, -1e9).to(dtype)
    mod = _Attn()
    got, _ = cpu_decode_attention(mod, q, k, v, m, scaling=0.3)
    want, _ = _sdpa(mod, q.float(), k.float(), v.float(), None if m is None else
                    (m if m.dtype == torch.bool else m.float()), scaling=0.3)
    assert got.shape == (B, 1, Hkv * G, D) and got.dtype == dtype
    # fp32: the same sums in another order; bf16: the output's own rounding (2^-8 relative)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_decode_attention_leaves_prefill_to_sdpa():
    q, k = torch.randn(1, 8, 3, 16), torch.randn(1, 2, 3, 16)
    got, _ = cpu_decode_attention(_Attn(), q, k, k, None, scaling=0.25)
    want, _ = _sdpa(_Attn(), q, k, k, None, scaling=0.25)
    assert torch.equal(got, want)


def test_dense_scheme_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dense_scheme_for("auto", QuantScheme.INT4, cpu, torch.bfloat16) is QuantScheme.INT8
    assert dense_scheme_for("auto", QuantScheme.BF16, cpu, torch.bfloat16) is QuantScheme.BF16
    assert dense_scheme_for("auto", QuantScheme.INT8, cpu, torch.float32) is None
    assert dense_scheme_for("auto", QuantScheme.INT8, cuda) is None
    assert dense_scheme_for("int4", QuantScheme.INT8, cpu, torch.float32) is QuantScheme.INT4
    assert dense_scheme_for("torch", QuantScheme.INT8, cpu) is None
    with pytest.raises(ValueError, match="runs the dense linears on the CPU"):
        dense_scheme_for("int8", QuantScheme.INT8, cuda)
    with pytest.raises(ValueError, match="dense_scheme must be one of"):
        PatchConfig(dense_scheme="fp8")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_patched_bf16_model_runs_its_dense_part_on_kt(family):
    require_kt_backend()
    base = tiny_model(family).to(torch.bfloat16)
    ids = torch.randint(0, base.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)
               and not n.endswith("mlp.gate")]
    want = _logits(patch_model(tiny_model(family).to(torch.bfloat16), PatchConfig(
        scheme="bf16", dense_scheme="torch"), progress=False), ids)
    model = patch_model(base, PatchConfig(scheme="bf16"), progress=False)
    kt_lin = {n for n, m in model.named_modules() if isinstance(m, KTLinear)}
    assert kt_lin == set(linears) and "lm_head" in kt_lin
    assert model.kt_patch.dense_scheme is QuantScheme.BF16 and model.kt_patch.dense_linears == len(linears)
    assert not any(isinstance(m, KTLinear) for n, m in model.named_modules() if n.endswith("mlp.gate"))
    assert model.config._attn_implementation == NAME
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=0.05)

    q = patch_model(tiny_model(family).to(torch.bfloat16), PatchConfig(scheme="bf16", dense_scheme="int8"),
                    progress=False)
    got = _logits(q, ids)
    rel = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel < 0.1 and agree >= 0.9, (rel, agree)


def test_greedy_decode_with_kt_attention_equals_sdpa():
    """Generation through the decode attention (one query per step) gives the tokens sdpa gives."""
    require_kt_backend()
    model = patch_model(tiny_model("qwen3_moe").to(torch.bfloat16), PatchConfig(scheme="bf16"), progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0)
    got = model.generate(ids, **kw)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_fp32_model_keeps_torch_linears():
    require_kt_backend()
    model = patch_model(tiny_model("qwen3_moe"), PatchConfig(scheme="int8"), progress=False)
    assert model.kt_patch.dense_scheme is None
    assert not any(isinstance(m, KTLinear) for m in model.modules())


def test_kt_linear_refuses_other_devices():
    from kt.cpu_ops.dense import DenseLinear

    lin = KTLinear(DenseLinear.from_tensor(np.ones((16, 64), np.float32), "int8"), None, name="x.q_proj")
    with pytest.raises(RuntimeError, match="x.q_proj runs on the CPU"):
        lin(torch.ones(1, 64, device="meta"))
