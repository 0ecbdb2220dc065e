"""Checks of kt's SGLang plugin, run INSIDE the SGLang virtual environment by the tests (importing
SGLang costs ~12 s, so one process runs them all and prints one JSON object on its last line).

    <sglang-venv>/bin/python tests/sglang_hook/_sglang_checks.py WORKDIR [cli] [layer]

Each check records {"ok": bool, ...} or {"ok": false, "error": traceback}; the pytest side asserts.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pickle
import sys
import traceback
from pathlib import Path

import numpy as np

RESULTS: dict = {}
E, H, I, K, L = 8, 128, 64, 2, 2
# non-contiguous hot experts, slots in a different order than the ids
HOT = {0: {1: 2, 4: 0, 6: 1}, 1: {0: 1, 7: 0}}


def record(name):
    def deco(fn):
        def run(*a, **kw):
            try:
                out = fn(*a, **kw) or {}
                RESULTS[name] = {"ok": True, **out}
            except BaseException as exc:  # noqa: BLE001 - report everything to the test
                RESULTS[name] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-6000:]}
        return run
    return deco


# ----------------------------------------------------------------------------- fixtures on disk

def tiny_checkpoint(root: Path) -> Path:
    """A qwen3_moe-shaped checkpoint holding only the routed experts (what kt convert reads)."""
    import torch
    from safetensors.torch import save_file

    src = root / "tiny-moe"
    if (src / "config.json").exists():
        return src
    src.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(L):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            tensors[f"{p}.gate_proj.weight"] = torch.randn(I, H, generator=g) / H ** 0.5
            tensors[f"{p}.up_proj.weight"] = torch.randn(I, H, generator=g) / H ** 0.5
            tensors[f"{p}.down_proj.weight"] = torch.randn(H, I, generator=g) / I ** 0.5
    save_file(tensors, str(src / "model.safetensors"))
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
           "moe_intermediate_size": I, "intermediate_size": 2 * H, "num_experts": E,
           "num_experts_per_tok": K, "num_hidden_layers": L, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "norm_topk_prob": True}
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def expert_weights(src: Path, layer: int):
    from safetensors.torch import load_file

    t = load_file(str(src / "model.safetensors"))
    p = f"model.layers.{layer}.mlp.experts"
    gate = np.stack([t[f"{p}.{e}.gate_proj.weight"].numpy() for e in range(E)])
    up = np.stack([t[f"{p}.{e}.up_proj.weight"].numpy() for e in range(E)])
    down = np.stack([t[f"{p}.{e}.down_proj.weight"].numpy() for e in range(E)])
    return gate, up, down


def placement_file(root: Path) -> Path:
    from kt.placement import Placement

    slot = np.full((L, E), -1, np.int32)
    for layer, m in HOT.items():
        for e, s in m.items():
            slot[layer, e] = s
    return Placement.from_slots(slot).save(root / "placement.json")


def stats_files(root: Path):
    import torch

    good = root / "stats.pt"
    torch.save({"logical_count": torch.arange(3 * L * E, dtype=torch.float32).reshape(3, L, E)}, good)
    bad = root / "stats_bad.pt"
    torch.save({"logical_count": torch.ones(3, L, E + 1)}, bad)
    return good, bad


# ----------------------------------------------------------------------------- checks

def parser_and_server_args():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser, ServerArgs


@record("plugin_loaded")
def check_plugin_loaded():
    from sglang.srt.layers.moe import kt_ep_wrapper
    from sglang.srt.layers.moe.fused_moe_triton import layer as fused_layer
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    from kt.sglang_hook._method import KTMoEMethod

    patched = sorted(t for t in HookRegistry._patched if "kt_ep_wrapper" in t or "ServerArgs" in t)
    assert kt_ep_wrapper.KTEPWrapperMethod is KTMoEMethod, kt_ep_wrapper.KTEPWrapperMethod
    assert fused_layer.KTEPWrapperMethod is KTMoEMethod, "FusedMoE's module still holds upstream's class"
    return {"patched": patched}


@record("cli_pickle")
def check_cli_pickle(root: Path, wdir: Path, stats: Path):
    from kt.sglang_hook._hooks import current_options

    parser, ServerArgs = parser_and_server_args()
    src = tiny_checkpoint(root)
    argv = ["--model-path", str(src), "--kt-weight-path", str(wdir), "--kt-method", "AMXINT8",
            "--kt-cpuinfer", "2", "--kt-threadpool-count", "1", "--kt-max-deferred-experts-per-token", "1",
            "--kt-numa-nodes", "0", "--kt-gpu-prefill-token-threshold", "auto",
            "--kt-enable-dynamic-expert-update", "--kt-expert-placement-strategy", "frequency",
            "--init-expert-location", str(stats), "--record-kt-gpu-expert-distribution",
            str(root / "rec.npz"), "--kt-gpu-expert-budget", "24GiB"]
    sa = ServerArgs.from_cli_args(parser.parse_args(argv))
    sa2 = pickle.loads(pickle.dumps(sa))
    got = current_options(sa2).to_dict()
    return {"options": got, "upstream_fields": {k: getattr(sa2, k) for k in (
        "kt_weight_path", "kt_method", "kt_cpuinfer", "kt_threadpool_count", "kt_num_gpu_experts",
        "kt_max_deferred_experts_per_token", "init_expert_location", "cuda_graph_backend_decode",
        "cuda_graph_backend_prefill")}}


@record("cli_errors")
def check_cli_errors(root: Path, wdir: Path, stats: Path, bad_stats: Path):
    from kt.sglang_hook._flags import KTArgumentError

    parser, ServerArgs = parser_and_server_args()
    src = str(tiny_checkpoint(root))
    cases = {
        "unknown_method": ["--kt-weight-path", str(wdir), "--kt-method", "AMXINT3"],
        "missing_weight_path": ["--kt-weight-path", str(root / "nowhere")],
        "stats_wrong_shape": ["--kt-weight-path", str(wdir), "--kt-num-gpu-experts", "2",
                              "--kt-expert-placement-strategy", "frequency",
                              "--init-expert-location", str(bad_stats)],
        "two_budgets": ["--kt-num-gpu-experts", "2", "--kt-gpu-experts-ratio", "0.5"],
        "frequency_without_stats": ["--kt-num-gpu-experts", "2", "--kt-expert-placement-strategy",
                                    "frequency"],
        "method_vs_directory": ["--kt-weight-path", str(wdir), "--kt-method", "BF16"],
        "deferred_too_many": ["--kt-weight-path", str(wdir), "--kt-max-deferred-experts-per-token", "2"],
        "cuda_graphs_on": ["--kt-weight-path", str(wdir), "--cuda-graph-backend-decode", "full"],
    }
    out = {}
    for name, extra in cases.items():
        try:
            ServerArgs.from_cli_args(parser.parse_args(["--model-path", src, *extra]))
            out[name] = None
        except KTArgumentError as exc:
            out[name] = str(exc)
    for name, extra in {"bad_threshold": ["--kt-gpu-prefill-token-threshold", "soon"],
                        "bad_budget": ["--kt-gpu-expert-budget", "lots"]}.items():
        err = io.StringIO()
        old, sys.stderr = sys.stderr, err
        try:
            parser.parse_args(["--model-path", src, *extra])
            out[name] = None
        except SystemExit:
            out[name] = err.getvalue().strip().splitlines()[-1]
        finally:
            sys.stderr = old
    return {"messages": out}


@record("kt_run_command")
def check_kt_run_command(root: Path, wdir: Path):
    """The command `kt run --dry-run` prints is one SGLang (with kt's plugin) accepts as it is."""
    import contextlib
    import shlex

    from kt.cli.main import main as kt_main
    from kt.sglang_hook._hooks import current_options

    src = tiny_checkpoint(root)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = kt_main(["run", str(src), "--dry-run", "--vram", "8GiB", "--kt-weight-path", str(wdir),
                      "--kt-method", "AMXINT8", "--kt-max-deferred-experts-per-token", "1",
                      "--python", sys.executable, "--", "--port", "31000"])
    assert rc == 0, buf.getvalue()
    cmd = shlex.split(buf.getvalue().strip().splitlines()[-1])
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"], cmd
    parser, ServerArgs = parser_and_server_args()
    sa = pickle.loads(pickle.dumps(ServerArgs.from_cli_args(parser.parse_args(cmd[3:]))))
    o = current_options(sa)
    return {"command": cmd[3:], "options": o.to_dict(), "port": sa.port, "model_path": sa.model_path}


def init_dist():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch
    from sglang.srt.distributed.parallel_state import init_distributed_environment

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")


def publish_cli(argv):
    """Publish a ServerArgs built from a command line (as the launcher does) for this process, after a
    pickle round trip (as the scheduler process receives it)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (destroy_model_parallel, initialize_model_parallel,
                                                       model_parallel_is_initialized)
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

    parser, ServerArgs = parser_and_server_args()
    sa = pickle.loads(pickle.dumps(ServerArgs.from_cli_args(parser.parse_args(argv))))
    if model_parallel_is_initialized():
        destroy_model_parallel()
    reset_context()
    publish(sa, role="test", ranks=SpawnRanks(world_rank=0))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    if not model_parallel_is_initialized():
        initialize_model_parallel(backend="gloo")
    return sa


def build_layer(layer_id: int, gate, up, down, dtype=None):
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    moe = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=layer_id, top_k=K,
                   params_dtype=dtype or torch.float32, prefix=f"model.layers.{layer_id}.mlp.experts")
    for e in range(E):  # the loading path SGLang's models take: param.weight_loader, global expert ids
        moe.w13_weight.weight_loader(moe.w13_weight, torch.from_numpy(gate[e]), "experts.w13_weight",
                                     shard_id="w1", expert_id=e)
        moe.w13_weight.weight_loader(moe.w13_weight, torch.from_numpy(up[e]), "experts.w13_weight",
                                     shard_id="w3", expert_id=e)
        moe.w2_weight.weight_loader(moe.w2_weight, torch.from_numpy(down[e]), "experts.w2_weight",
                                    shard_id="w2", expert_id=e)
    moe.quant_method.process_weights_after_loading(moe)
    return moe


def reference(x, ids, w, gate, up, down, hot_mask, scheme, group_size=64):
    """Hot experts in fp32 (SGLang's own GPU method computes them from the checkpoint weights), cold
    experts as the CPU kernels compute them: reference(dequantize(quantize(w)))."""
    from kt import reference as R

    w13 = np.concatenate([gate, up], axis=1)
    hot = R.moe_forward(x, ids, w, w13, down, skip_mask=~hot_mask)
    q13 = [R.quantize(w13[e], scheme, group_size) for e in range(E)]
    q2 = [R.quantize(down[e], scheme, group_size) for e in range(E)]
    cold = R.moe_forward_quantized(x, ids, w, q13, q2, skip_mask=hot_mask)
    return hot.astype(np.float64) + cold


def routing(T: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    w = w / w.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    if T > 2:
        ids[1, 1] = -1  # an empty slot
    return x, ids, w, logits


def close(out, ref, what):
    from kt.testing import assert_close

    rms = float(np.sqrt(np.mean(ref ** 2)))
    # int8 weights and per-token int8 activations are in the reference; what remains is fp32
    # accumulation order (kernel vs fp64 reference) and the fp32 GPU-method path
    assert_close(ref, out.float().numpy(), rtol=1e-4, atol=1e-4 * rms + 1e-30, what=what)
    return float(np.abs(out.float().numpy() - ref).max() / (np.abs(ref).max() + 1e-30))


@record("fused_moe")
def check_fused_moe(root: Path, wdir: Path, pfile: Path, stats: Path):
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    src = tiny_checkpoint(root)
    logs = io.StringIO()
    h = logging.StreamHandler(logs)
    logging.getLogger("kt.sglang_hook").addHandler(h)
    logging.getLogger("kt.sglang_hook").setLevel(logging.INFO)
    init_dist()
    rec = root / "recorded.npz"
    publish_cli(["--model-path", str(src), "--device", "cpu", "--kt-weight-path", str(wdir),
                 "--kt-method", "AMXINT8", "--kt-placement", str(pfile), "--kt-cpuinfer", "2",
                 "--record-kt-gpu-expert-distribution", str(rec)])
    out = {}
    expect = np.zeros((L, E))

    def count(layer_id, ids):
        v = ids.numpy().reshape(-1)
        expect[layer_id] += np.bincount(v[v >= 0], minlength=E)
    for layer_id in range(L):
        gate, up, down = expert_weights(src, layer_id)
        moe = build_layer(layer_id, gate, up, down)
        qm = moe.quant_method
        assert type(qm).__name__ == "KTMoEMethod", type(qm)
        hot = HOT[layer_id]
        assert tuple(moe.w13_weight.shape) == (len(hot), 2 * I, H), moe.w13_weight.shape
        for e, s in hot.items():  # SGLang's layout: gate rows then up rows, the expert in its slot
            torch.testing.assert_close(moe.w13_weight[s], torch.cat([torch.from_numpy(gate[e]),
                                                                     torch.from_numpy(up[e])]),
                                       rtol=0, atol=0)
            torch.testing.assert_close(moe.w2_weight[s], torch.from_numpy(down[e]), rtol=0, atol=0)
        hot_mask = np.zeros(E, bool)
        hot_mask[list(hot)] = True
        for T in (1, 7, 40):
            x, ids, w, logits = routing(T, seed=100 * layer_id + T)
            y = moe(x, StandardTopKOutput(w, ids, logits))
            count(layer_id, ids)
            ref = reference(x.numpy(), ids.numpy(), w.numpy(), gate, up, down, hot_mask, "int8")
            out[f"layer{layer_id}_T{T}_max_rel"] = close(y, ref, f"layer {layer_id} T={T}")
        # a batch routed only to CPU experts and one only to GPU experts
        x, ids, w, logits = routing(5, seed=7)
        cold_ids = np.nonzero(~hot_mask)[0]
        ids_c = torch.from_numpy(np.stack([cold_ids[:K]] * 5).astype(np.int32))
        y = moe(x, StandardTopKOutput(w, ids_c, logits))
        count(layer_id, ids_c)
        close(y, reference(x.numpy(), ids_c.numpy(), w.numpy(), gate, up, down, hot_mask, "int8"), "all cold")
        ids_h = torch.from_numpy(np.stack([sorted(hot)[:K]] * 5).astype(np.int32))
        y = moe(x, StandardTopKOutput(w, ids_h, logits))
        count(layer_id, ids_h)
        close(y, reference(x.numpy(), ids_h.numpy(), w.numpy(), gate, up, down, hot_mask, "int8"), "all hot")
    from kt.placement import ExpertStats
    from kt.sglang_hook._process import proc

    proc._save_stats(str(rec))  # what the atexit hook does
    out["recorded_counts_match"] = bool(np.array_equal(ExpertStats.load(rec).counts, expect))
    line = [l for l in logs.getvalue().splitlines() if "SGLang integration active" in l]
    out["log"] = line
    return out


@record("fused_moe_bf16")
def check_bf16(root: Path, wdir: Path, pfile: Path):
    """The serving dtype: bf16 weights and activations (SGLang's path rounds its GEMM outputs and
    SiLU*up to bf16, kt's CPU experts return bf16), so the bound is bf16's: rtol 2^-6 + 2e-2 * rms."""
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from kt import reference as R
    from kt.testing import assert_close

    src = tiny_checkpoint(root)
    init_dist()
    publish_cli(["--model-path", str(src), "--device", "cpu", "--kt-weight-path", str(wdir),
                 "--kt-placement", str(pfile)])
    gate, up, down = expert_weights(src, 0)
    moe = build_layer(0, gate, up, down, dtype=torch.bfloat16)
    hot_mask = np.zeros(E, bool)
    hot_mask[list(HOT[0])] = True
    x, ids, w, logits = routing(24, seed=21)
    y = moe(x.bfloat16(), StandardTopKOutput(w, ids, logits))
    assert y.dtype == torch.bfloat16, y.dtype
    xb = R.bf16_round(x.numpy())
    w13 = np.concatenate([gate, up], axis=1)
    hot = R.moe_forward(xb, ids.numpy(), w.numpy(), R.bf16_round(w13), R.bf16_round(down), skip_mask=~hot_mask)
    q13 = [R.quantize(w13[e], "int8") for e in range(E)]
    q2 = [R.quantize(down[e], "int8") for e in range(E)]
    ref = hot.astype(np.float64) + R.moe_forward_quantized(xb, ids.numpy(), w.numpy(), q13, q2, skip_mask=hot_mask)
    rms = float(np.sqrt(np.mean(ref ** 2)))
    assert_close(ref, y.float().numpy(), rtol=2 ** -6, atol=2e-2 * rms, what="bf16 layer")
    return {"max_rel": float(np.abs(y.float().numpy() - ref).max() / np.abs(ref).max())}


@record("fused_moe_deferred")
def check_deferred(root: Path, wdir: Path, pfile: Path):
    """--kt-max-deferred-experts-per-token 1: layer 0's lowest-weight CPU expert per token is added to
    layer 1's output; the sum of both layers' outputs is unchanged."""
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from kt.sglang_hook._process import proc

    src = tiny_checkpoint(root)
    init_dist()
    proc.chain = None
    publish_cli(["--model-path", str(src), "--device", "cpu", "--kt-weight-path", str(wdir),
                 "--kt-placement", str(pfile), "--kt-max-deferred-experts-per-token", "1"])
    ws = [expert_weights(src, l) for l in range(L)]
    layers = [build_layer(l, *ws[l]) for l in range(L)]
    assert layers[0].quant_method.layer.max_deferred == 1 and layers[1].quant_method.layer.max_deferred == 0
    x, ids, w, logits = routing(9, seed=3)
    y0 = layers[0](x, StandardTopKOutput(w, ids, logits))
    y1 = layers[1](x, StandardTopKOutput(w, ids, logits))
    refs = []
    for l in range(L):
        hot_mask = np.zeros(E, bool)
        hot_mask[list(HOT[l])] = True
        refs.append(reference(x.numpy(), ids.numpy(), w.numpy(), *ws[l], hot_mask, "int8"))
    moved = float(np.abs(y0.numpy() - refs[0]).max() / np.abs(refs[0]).max())
    assert moved > 1e-2, f"layer 0 deferred nothing (rel diff {moved})"
    close(y0 + y1, refs[0] + refs[1], "layer 0 + layer 1 with deferral")
    return {"layer0_rel_change": moved}


@record("fused_moe_convert_on_load")
def check_convert_on_load(root: Path, pfile: Path):
    """No --kt-weight-path: the CPU experts are quantised (int4, --kt-method AMXINT4) from the
    checkpoint tensors SGLang's loader passes."""
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    src = tiny_checkpoint(root)
    init_dist()
    publish_cli(["--model-path", str(src), "--device", "cpu", "--kt-placement", str(pfile),
                 "--kt-method", "AMXINT4"])
    gate, up, down = expert_weights(src, 1)
    moe = build_layer(1, gate, up, down)
    hot_mask = np.zeros(E, bool)
    hot_mask[list(HOT[1])] = True
    x, ids, w, logits = routing(11, seed=5)
    y = moe(x, StandardTopKOutput(w, ids, logits))
    return {"max_rel": close(y, reference(x.numpy(), ids.numpy(), w.numpy(), gate, up, down, hot_mask,
                                          "int4", 64), "converted while loading (int4)")}


@record("fused_moe_dynamic")
def check_dynamic(root: Path, wdir: Path, pfile: Path):
    """--kt-enable-dynamic-expert-update: routing that favours cold experts moves them to GPU slots
    (weights dequantised from the CPU's int8 copy); the layer still matches the reference after."""
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from kt import reference as R
    from kt.sglang_hook._process import proc

    src = tiny_checkpoint(root)
    init_dist()
    proc.placer, proc.methods, proc.chain = None, {}, None
    publish_cli(["--model-path", str(src), "--device", "cpu", "--kt-weight-path", str(wdir),
                 "--kt-placement", str(pfile), "--kt-enable-dynamic-expert-update"])
    ws = [expert_weights(src, l) for l in range(L)]
    layers = [build_layer(l, *ws[l]) for l in range(L)]
    placer = proc.placer
    placer.every_n_tokens, placer.drift_threshold, placer.hysteresis = 16, 0.0, 0.0
    # every token to experts 0 and 2 (cold in layer 0) and 3, 5 (cold in layer 1)
    x, _, w, logits = routing(32, seed=11)
    for l, pair in ((0, (0, 2)), (1, (3, 5))):
        ids = torch.tensor([pair] * 32, dtype=torch.int32)
        layers[l](x, StandardTopKOutput(w, ids, logits))
    assert proc.replacements == 1, proc.replacements
    out = {}
    for l, pair in ((0, (0, 2)), (1, (3, 5))):
        qm = layers[l].quant_method
        assert all(qm.gpu_slot[e] >= 0 for e in pair), qm.gpu_slot.tolist()
        gate, up, down = ws[l]
        hot_mask = qm.gpu_slot >= 0
        w13 = np.concatenate([gate, up], axis=1)
        w13_hot, w2_hot = w13.copy(), down.copy()
        for e in np.nonzero(hot_mask & (np.asarray([HOT[l].get(i, -1) for i in range(E)]) < 0))[0]:
            # a newly hot expert computes with the CPU's int8 values, rounded to bf16 on the way
            w13_hot[e] = R.bf16_round(R.dequantize(R.quantize(w13[e], "int8")))
            w2_hot[e] = R.bf16_round(R.dequantize(R.quantize(down[e], "int8")))
        x2, ids2, w2_, logits2 = routing(20, seed=13)
        y = layers[l](x2, StandardTopKOutput(w2_, ids2, logits2))
        ref_hot = R.moe_forward(x2.numpy(), ids2.numpy(), w2_.numpy(), w13_hot, w2_hot, skip_mask=~hot_mask)
        q13 = [R.quantize(w13[e], "int8") for e in range(E)]
        q2 = [R.quantize(down[e], "int8") for e in range(E)]
        ref_cold = R.moe_forward_quantized(x2.numpy(), ids2.numpy(), w2_.numpy(), q13, q2, skip_mask=hot_mask)
        out[f"layer{l}_max_rel"] = close(y, ref_hot.astype(np.float64) + ref_cold, f"layer {l} after update")
        out[f"layer{l}_gpu_experts"] = sorted(int(e) for e in np.nonzero(hot_mask)[0])
    return out


def main():
    root = Path(sys.argv[1])
    what = set(sys.argv[2:]) or {"cli", "layer"}
    root.mkdir(parents=True, exist_ok=True)
    import kt.weights

    src = tiny_checkpoint(root)
    wdir = root / "kt-int8"
    kt.weights.convert(src, wdir, scheme="int8", progress=False)
    pfile = placement_file(root)
    stats, bad_stats = stats_files(root)
    check_plugin_loaded()
    if "cli" in what:
        check_cli_pickle(root, wdir, stats)
        check_cli_errors(root, wdir, stats, bad_stats)
        check_kt_run_command(root, wdir)
    if "layer" in what:
        check_fused_moe(root, wdir, pfile, stats)
        check_bf16(root, wdir, pfile)
        check_deferred(root, wdir, pfile)
        check_convert_on_load(root, pfile)
        check_dynamic(root, wdir, pfile)
    print("\nKT_CHECKS_JSON " + json.dumps(RESULTS, default=str))


if __name__ == "__main__":
    main()
