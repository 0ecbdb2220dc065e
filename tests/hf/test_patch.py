"""kt.patch_model on tiny random models of every supported family: accuracy against unpatched
transformers (the issue's acceptance bounds), what is replaced and kept, and clear errors."""
from __future__ import annotations

import copy

import pytest
import torch

from _hf_models import require_kt_backend, tiny_model  # noqa: E402  (sets the transformers skip)

from kt.hf import FAMILIES, PatchConfig, patch_model
from kt.hf._experts import KTExperts
from kt.hf.accuracy import KL_BOUNDS, compare_models, random_prompts

FAMILY_NAMES = sorted(FAMILIES)
GREEDY_STEPS = 16


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_accuracy_within_scheme_bounds(family):
    """Patched (kt CPUMoE) vs unpatched fp32 transformers on 3 prompts x 24 tokens:
    mean per-token KL <= 1e-4 (BF16, plus identical greedy tokens for 16 steps on every prompt),
    2e-3 (INT8), 2e-2 (INT4, G = 64)."""
    require_kt_backend()
    ref = tiny_model(family)
    prompts = random_prompts(ref.config.vocab_size, n=3, length=24, seed=0)
    report = {}
    for scheme in ("bf16", "int8", "int4"):
        m = patch_model(copy.deepcopy(ref), PatchConfig(scheme=scheme, group_size=64), progress=False)
        assert m.kt_patch.backend == "cpu"
        a = compare_models(ref, m, prompts, greedy_steps=GREEDY_STEPS if scheme == "bf16" else 0)
        report[scheme] = a
        print(f"{family} {scheme}: {a}")
    for scheme, a in report.items():
        assert a.mean_kl <= KL_BOUNDS[scheme], f"{family} {scheme}: {a}"
    assert report["bf16"].greedy_identical, f"{family} bf16: {report['bf16']}"


def test_kt_matches_reference_backend():
    """The CPUMoE path and kt.reference (the spec, in numpy) compute the same model output:
    both quantise identically; only fp32 summation order differs."""
    require_kt_backend()
    ref = tiny_model("qwen3_moe")
    ids = random_prompts(ref.config.vocab_size, n=1, length=16, seed=3)[0]
    for scheme in ("int8", "int4", "bf16"):
        a = patch_model(copy.deepcopy(ref), PatchConfig(scheme=scheme), progress=False)
        with pytest.warns(UserWarning, match="reference"):
            b = patch_model(copy.deepcopy(ref), PatchConfig(scheme=scheme, backend="reference"),
                            progress=False)
        with torch.no_grad():
            la, lb = a(ids).logits, b(ids).logits
        # fp32 accumulation order (kernels) vs fp64 (reference); logits have std ~2
        torch.testing.assert_close(la, lb, rtol=0, atol=2e-3, msg=f"{scheme}")


def test_two_level_activations_are_closer_to_transformers():
    """PatchConfig(activations="int8x2"): INT8 experts with two-level activations agree with
    the reference backend's two-level arithmetic and are closer to unpatched transformers than
    per-token int8 activations."""
    require_kt_backend()
    ref = tiny_model("qwen3_moe")
    prompts = random_prompts(ref.config.vocab_size, n=3, length=24, seed=0)
    one = patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8"), progress=False)
    two = patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8", activations="int8x2"),
                      progress=False)
    a1 = compare_models(ref, one, prompts, greedy_steps=0)
    a2 = compare_models(ref, two, prompts, greedy_steps=0)
    print(f"int8: {a1}\nint8x2: {a2}")
    assert a2.mean_kl < a1.mean_kl and a2.mean_kl <= KL_BOUNDS["int8"]
    with pytest.warns(UserWarning, match="reference"):
        spec = patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8", activations="int8x2",
                                                           backend="reference"), progress=False)
    with torch.no_grad():
        torch.testing.assert_close(two(prompts[0]).logits, spec(prompts[0]).logits, rtol=0,
                                   atol=2e-3)


def test_only_the_experts_are_replaced_and_freed():
    require_kt_backend()
    for family in ("qwen2_moe", "deepseek_v3"):
        m = tiny_model(family)
        blocks = {n: mod for n, mod in m.named_modules() if hasattr(mod, "experts")
                  and hasattr(getattr(mod, "experts"), "gate_up_proj")}
        kept = {n: (b.gate, getattr(b, "shared_expert", None), getattr(b, "shared_experts", None),
                    getattr(b, "shared_expert_gate", None)) for n, b in blocks.items()}
        n_params = sum(p.numel() for p in m.parameters())
        e, i2, h = next(iter(blocks.values())).experts.gate_up_proj.shape
        patch_model(m, PatchConfig(scheme="int8"), progress=False)
        for n, b in blocks.items():
            assert isinstance(b.experts, KTExperts), n
            assert (b.gate, getattr(b, "shared_expert", None), getattr(b, "shared_experts", None),
                    getattr(b, "shared_expert_gate", None)) == kept[n], f"{family} {n}: router/shared changed"
        expert_params = len(blocks) * e * (i2 * h + h * (i2 // 2))
        assert sum(p.numel() for p in m.parameters()) == n_params - expert_params
        assert m.kt_patch.freed_bytes == expert_params * 4
        assert m.kt_patch.layers == tuple(sorted(b.experts.layer_idx for b in blocks.values()))
        if family == "deepseek_v3":
            assert 0 not in m.kt_patch.layers  # first_k_dense_replace = 1: layer 0 is dense


class _DropLowest:
    """A deliberately broken backend: forgets each token's lowest-weight expert (a plausible
    kernel bug). The acceptance test must be able to see it."""

    def __init__(self, moe):
        self.moe = moe

    def __call__(self, x, ids, w):
        w = w.clone()
        w.scatter_(1, w.argmin(dim=1, keepdim=True), 0.0)
        return self.moe(x, ids, w)


def test_acceptance_check_catches_a_broken_backend():
    require_kt_backend()
    ref = tiny_model("qwen3_moe")
    prompts = random_prompts(ref.config.vocab_size, n=3, length=24, seed=0)
    m = patch_model(copy.deepcopy(ref), PatchConfig(scheme="bf16"), progress=False)
    for mod in m.modules():
        if isinstance(mod, KTExperts):
            mod.moe = _DropLowest(mod.moe)
    a = compare_models(ref, m, prompts, greedy_steps=0)
    print(f"drop-lowest-expert bug: {a}")
    assert a.mean_kl > 10 * KL_BOUNDS["bf16"]


def test_bf16_model_dtype_roundtrip():
    """A bf16 model (as checkpoints are shipped) runs through kt and returns bf16."""
    require_kt_backend()
    ref = tiny_model("mixtral")
    m = patch_model(copy.deepcopy(ref).to(torch.bfloat16), PatchConfig(scheme="bf16"), progress=False)
    ids = random_prompts(ref.config.vocab_size, n=1, length=8, seed=1)[0]
    with torch.no_grad():
        out = m(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    a = compare_models(ref, m, [ids], greedy_steps=0)
    assert a.mean_kl < 1e-2, a  # bf16 attention/norms too: far looser than the experts alone


# ----------------------------------------------------------------------------- errors

def test_unknown_and_unsupported_architectures():
    from transformers import AutoConfig, AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="does not know model_type 'llama'.*supported: deepseek_v2"):
        patch_model(llama)
    gpt_oss = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="gpt_oss.*SwiGLU"):
        patch_model(gpt_oss)


def test_already_patched_and_nothing_changed_on_failure():
    require_kt_backend()
    m = patch_model(tiny_model("olmoe"), PatchConfig(scheme="int8"), progress=False)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(m)
    # a patch refused during validation leaves the model untouched
    from kt.placement import Placement

    m2 = tiny_model("olmoe")
    wrong = Placement.all_cpu(m2.config.num_hidden_layers + 1, 16)
    with pytest.raises(ValueError):
        patch_model(m2, PatchConfig(scheme="int8", placement=wrong), progress=False)
    assert not any(isinstance(x, KTExperts) for x in m2.modules())
    assert not hasattr(m2, "kt_patch")


@pytest.mark.parametrize("kw, match", [
    (dict(scheme="fp4"), "unknown quantisation scheme"),
    (dict(group_size=48), "group_size must be one of"),
    (dict(threads=0), "threads must be a positive int"),
    (dict(deferral=-1), "deferral must be an int >= 0"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(scheme="int8", activations="int16"), "activations must be"),
    (dict(scheme="bf16", activations="int8x2"), "applies to the int8 and int4"),
])
def test_patch_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        PatchConfig(**kw)


def test_missing_transformers_names_the_extra(monkeypatch):
    import sys

    from kt.hf import _compat

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'kt\[hf\]'"):
        _compat.require_transformers()


def test_placement_hooks():
    """An all-CPU placement goes through HybridMoE on a CPU-only host and gives the CPU-only
    result; a placement with GPU experts on a model that runs on the CPU is refused."""
    require_kt_backend()
    pytest.importorskip("kt.layer")
    from kt.placement import Placement

    ref = tiny_model("qwen3_moe")
    L, E = ref.config.num_hidden_layers, 16
    ids = random_prompts(ref.config.vocab_size, n=1, length=12, seed=2)[0]
    cpu = patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8"), progress=False)
    hyb = patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8", placement=Placement.all_cpu(L, E)),
                      progress=False)
    assert hyb.kt_patch.backend == "hybrid"
    with torch.no_grad():
        torch.testing.assert_close(hyb(ids).logits, cpu(ids).logits, rtol=0, atol=1e-5)
    half = Placement.from_mask(torch.arange(E).repeat(L, 1).numpy() % 2 == 0)
    with pytest.raises(ValueError, match="puts experts on the GPU"):
        patch_model(copy.deepcopy(ref), PatchConfig(scheme="int8", placement=half), progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (HybridMoE's GPU experts)")
@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_hybrid_half_the_experts_on_gpu_matches_cpu_only(scheme):
    """Acceptance on a GPU machine: half of each layer's experts on the GPU (HybridMoE) agrees
    with the all-CPU run, and both with unpatched transformers, within the scheme's bound."""
    require_kt_backend()
    from kt.placement import Placement

    ref = tiny_model("qwen3_moe").cuda()
    L, E = ref.config.num_hidden_layers, 16
    half = Placement.from_mask(torch.arange(E).repeat(L, 1).numpy() % 2 == 1)
    prompts = [p.cuda() for p in random_prompts(ref.config.vocab_size, n=3, length=24, seed=0)]
    cpu = patch_model(copy.deepcopy(ref), PatchConfig(scheme=scheme), progress=False)
    hyb = patch_model(copy.deepcopy(ref), PatchConfig(scheme=scheme, placement=half), progress=False)
    assert hyb.kt_patch.backend == "hybrid" and cpu.kt_patch.backend == "cpu"
    a_hc = compare_models(cpu, hyb, prompts, greedy_steps=GREEDY_STEPS)
    a_hr = compare_models(ref, hyb, prompts, greedy_steps=0)
    print(f"hybrid vs cpu-only {scheme}: {a_hc}\nhybrid vs transformers {scheme}: {a_hr}")
    assert a_hc.mean_kl <= KL_BOUNDS[scheme] and a_hr.mean_kl <= KL_BOUNDS[scheme]


def test_importing_kt_hf_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, kt, kt.hf; kt.hf.PatchConfig; kt.patch_model; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "assert 'numba' not in sys.modules, 'numba imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
