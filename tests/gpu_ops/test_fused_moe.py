"""kt.gpu_ops.fused_moe vs kt.reference.moe_forward.

Kernel cases (in _cases.py, where the tolerances are stated) run on the GPU where there is one, else
under the Triton interpreter in a worker process (conftest.py). Input checks and the slot alignment
run here.
"""
import subprocess
import sys

import pytest
import torch

import _cases
from kt.gpu_ops import fused_moe

# Non-contiguous slot maps (holes, slots out of expert order). With T=1 at most K experts are routed,
# so some GPU slots get no token.
E2S_A = [3, -1, 0, 5, -1, 1, 2, 4]
E2S_B = [-1, 2, -1, -1, 0, -1, 1, -1]


@pytest.mark.parametrize("t,k,h,i,e2s,dtype", [
    (1, 2, 64, 32, E2S_A, "bf16"),
    (7, 4, 128, 96, E2S_B, "bf16"),
    (33, 4, 128, 96, E2S_A, "bf16"),
    (33, 2, 64, 32, list(range(8)), "fp32"),
    (7, 3, 128, 96, E2S_A, "fp32"),
    (1, 4, 128, 64, E2S_B, "int8"),
    (33, 4, 64, 96, E2S_A, "int8"),
    (0, 2, 64, 32, E2S_A, "bf16"),
    # T=2 with T*K > 8: the direct path by default (configs.takes_direct: T <= 2)
    (2, 8, 64, 32, E2S_A, "bf16"),
    (2, 6, 128, 96, E2S_B, "int8"),
])
def test_fused_moe_vs_reference(run_case, t, k, h, i, e2s, dtype):
    run_case(_cases.fused_case, t, 8, k, h, i, e2s, dtype, 100 + t + k + h + i)


def test_forced_config_edges(run_case):
    # block_m larger than any slot's rows, block_k > H, group_m not dividing the row blocks.
    cfg = dict(block_m=32, block_n=64, block_k=128, group_m=3, num_warps=4, num_stages=2)
    run_case(_cases.fused_case, 7, 8, 2, 64, 32, E2S_A, "fp32", 11, 0.0, cfg)


SORTED_SMALL = dict(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("cfg,t,k,h,i,dtype", [
    # weight tiles through TMA descriptors: tails in I (gate tiles read into up rows, up tiles into
    # the next slot's rows) and in H (columns past H read as zeros), int8 and fp32 weights
    (dict(block_m=16, block_n=32, block_k=32, tma=True), 9, 3, 96, 80, "fp32"),
    (dict(block_m=16, block_n=64, block_k=64, tma=True, flatten=True), 17, 4, 160, 96, "int8"),
    # bf16 output: y stored in bf16; TMA for gate+up only where the down tiles are too wide for a box
    (dict(block_m=32, block_n=32, block_k=64, tma=True, down_block_n=512, down_flatten=True), 33, 4, 128,
     96, "bf16"),
    # rows of H=72 fp32 (288 bytes) are 16-byte aligned, I=36 (144 bytes) too; H=70 bf16 (140 bytes) is
    # not: those weights keep pointer loads
    (dict(block_m=16, block_n=16, block_k=16, tma=True), 5, 2, 72, 36, "fp32"),
    (dict(block_m=16, block_n=16, block_k=16, tma=True, flatten=True), 5, 2, 70, 40, "bf16"),
])
def test_sorted_path_tma_and_flatten(run_case, cfg, t, k, h, i, dtype):
    run_case(_cases.fused_case, t, 8, k, h, i, E2S_A, dtype, 500 + t + k, 0.1, dict(group_m=2, **cfg))


@pytest.mark.parametrize("cfg,t,k,h,i", [
    # two-level int8 activations on int8 tensor cores: tails in H (block_k) and I (block_n),
    # pointer and TMA weight tiles, a flattened tile loop
    (dict(block_m=16, block_n=32, block_k=64, a8=True), 33, 4, 160, 96),
    (dict(block_m=32, block_n=64, block_k=32, tma=True, a8=True), 9, 3, 96, 80),
    (dict(block_m=16, block_n=16, block_k=64, tma=True, flatten=True, a8=True), 17, 4, 128, 40),
])
def test_sorted_path_two_level_int8_activations(run_case, cfg, t, k, h, i):
    run_case(_cases.fused_case, t, 8, k, h, i, E2S_A, "int8", 600 + t + k, 0.1, dict(group_m=2, **cfg))


@pytest.mark.parametrize("cfg,t,k,h,i,dtype", [
    # each kernel with its own row block; slots padded to the larger (MoEConfig.align_m)
    (dict(block_m=16, down_block_m=32, block_n=32, block_k=32), 33, 4, 96, 80, "fp32"),
    (dict(block_m=32, down_block_m=16, block_n=16, block_k=64, tma=True, a8=True), 21, 3, 128, 48, "int8"),
    (dict(block_m=16, down_block_m=64, block_n=32, block_k=64, flatten=True), 9, 8, 64, 32, "bf16"),
])
def test_sorted_path_own_row_blocks(run_case, cfg, t, k, h, i, dtype):
    run_case(_cases.fused_case, t, 8, k, h, i, E2S_A, dtype, 700 + t + k, 0.1, dict(group_m=2, **cfg))


@pytest.mark.parametrize("cfg,t,k,h,i,dtype", [
    # h in sorted order: by TMA (the down's weights by TMA), a partial last k block (I=40), a8, and
    # the gate+up's own row blocks; by pointers (forced on a config without TMA)
    (dict(block_m=16, block_n=32, block_k=32, tma=True), 9, 3, 96, 80, "bf16"),
    (dict(block_m=16, block_n=16, block_k=32, tma=True, flatten=True), 17, 4, 64, 40, "int8"),
    (dict(block_m=16, down_block_m=32, block_n=16, block_k=64, tma=True, a8=True), 21, 3, 128, 48, "int8"),
    (dict(block_m=16, block_n=32, block_k=64), 13, 2, 64, 48, "bf16"),
])
def test_sorted_h_is_bit_identical(run_case, cfg, t, k, h, i, dtype):
    run_case(_cases.sorted_h_case, t, 8, k, h, i, E2S_A, dtype, 800 + t + k, dict(group_m=2, **cfg))


# (rows per program: 8 at H=64, 2 at H=1500 (37 rows: a partial last program), 1 at H=2500; H=9000
# is read in three passes)
@pytest.mark.parametrize("t,h,dtype", [(5, 64, "fp32"), (37, 1500, "fp32"), (6, 2500, "fp32"), (4, 96, "bf16"),
                                       (3, 9000, "fp32")])
def test_act_quant2_vs_reference(run_case, t, h, dtype):
    run_case(_cases.act_quant2_case, t, h, 7 + t + h, dtype)


def test_a8_needs_int8_weights():
    from kt.gpu_ops.configs import MoEConfig

    a = _args()
    with pytest.raises(ValueError, match="a8 .* needs int8 weights"):
        fused_moe(a["x"], a["topk_ids"], a["topk_weights"], a["expert_to_slot"], a["w13"], a["w2"],
                  config=MoEConfig(a8=True))
    with pytest.raises(ValueError, match="a8 must be a bool"):
        MoEConfig(a8=1)
    assert "a8" not in MoEConfig().to_dict() and MoEConfig(a8=True).to_dict()["a8"] is True


def test_tma_only_where_the_weights_allow():
    from kt.gpu_ops import moe
    from kt.gpu_ops.configs import MoEConfig

    if moe._tensor_descriptor() is None:
        pytest.skip("this Triton has no host-side TMA descriptors")
    on = MoEConfig(block_m=16, block_n=32, block_k=32, tma=True)
    assert moe._weight_desc(torch.zeros(2, 64, 64, dtype=torch.bfloat16), on)[1]
    assert not moe._weight_desc(torch.zeros(2, 64, 64, dtype=torch.bfloat16), MoEConfig())[1]
    assert not moe._weight_desc(torch.zeros(2, 64, 70, dtype=torch.bfloat16), on)[1]  # 140-byte rows
    assert not moe._weight_desc(torch.zeros(2, 64, 128)[:, :, :64], on)[1]  # not contiguous
    assert not moe._weight_desc(torch.zeros(2, 64, 64).transpose(1, 2), on)[1]  # no [S*R, C] view
    assert moe._act_desc(torch.zeros(48, 64, dtype=torch.bfloat16), on)[1]
    assert not moe._act_desc(torch.zeros(48, 70, dtype=torch.bfloat16), on)[1]  # 140-byte rows
    wide = MoEConfig(block_m=16, block_n=512, block_k=32, tma=True)
    assert not moe._weight_desc(torch.zeros(2, 64, 64), wide)[1]  # box over 256
    assert MoEConfig(tma=True, flatten=True, down_flatten=False).for_down().flatten is False
    assert MoEConfig(tma=True, flatten=True).for_down().tma
    with pytest.raises(ValueError, match="tma must be a bool"):
        MoEConfig(tma=1)


@pytest.mark.parametrize("t,k,h,i,e2s,dtype", [
    (1, 2, 64, 32, E2S_A, "fp32"),
    (7, 4, 128, 96, E2S_B, "bf16"),
    (3, 3, 64, 96, E2S_A, "int8"),
])
def test_sorted_path_at_decode_sizes(run_case, t, k, h, i, e2s, dtype):
    # Decode-sized calls take the direct path by default; the sorted path must stay right there too.
    run_case(_cases.fused_case, t, 8, k, h, i, e2s, dtype, 300 + t + k, 0.1, SORTED_SMALL)


@pytest.mark.parametrize("cfg,t,k,h,i,dtype", [
    # block_k > H and block_n > I (masked tails), a down row read in several steps (down_block_k < I),
    # one column per down program, N = T*K = 64 (the default's limit), an odd K.
    (dict(block_n=64, block_k=128, down_block_n=1, down_block_k=16), 5, 3, 64, 48, "fp32"),
    (dict(block_n=16, block_k=32, down_block_n=8, down_block_k=32), 16, 4, 96, 80, "fp32"),
    (dict(block_n=16, block_k=32, down_block_n=32, down_block_k=64, num_stages=1), 9, 7, 64, 32, "int8"),
    (dict(), 1, 8, 128, 64, "bf16"),
    # GEMV gate+up per token-slot: narrow and odd-tailed column blocks, K steps over H
    (dict(gate_up="pairs", block_n=4, block_k=32), 7, 3, 80, 48, "fp32"),
    (dict(gate_up="pairs", block_n=1, block_k=128, down_block_n=2), 2, 4, 64, 32, "int8"),
    (dict(gate_up="pairs", block_n=16, block_k=16), 3, 8, 64, 96, "bf16"),
    # pipelined k loops (cp.async stages on a GPU): more steps than stages, fewer, and a masked tail
    (dict(gate_up="pairs", block_n=4, block_k=16, num_stages=4, down_block_n=2, down_block_k=16,
          down_num_stages=3), 2, 4, 80, 48, "int8"),
    (dict(gate_up="pairs", block_n=8, block_k=64, num_stages=3, down_block_n=4, down_block_k=32,
          down_num_stages=5), 1, 8, 64, 80, "bf16"),
])
def test_direct_path_configs(run_case, cfg, t, k, h, i, dtype):
    run_case(_cases.fused_case, t, 8, k, h, i, E2S_A, dtype, 400 + t + k, 0.1, dict(path="direct", **cfg))


def test_direct_path_is_the_decode_default():
    from kt.gpu_ops import DirectConfig, MoEConfig, pick_config
    from kt.gpu_ops.configs import DIRECT_MAX_N, DIRECT_MAX_T

    assert isinstance(pick_config(1, 8, 32, 2048, 768, "bf16"), DirectConfig)
    # up to DIRECT_MAX_T tokens whatever K is; beyond, while T*K <= DIRECT_MAX_N
    assert isinstance(pick_config(DIRECT_MAX_T, 8, 32, 2048, 768, "int8"), DirectConfig)
    assert isinstance(pick_config(DIRECT_MAX_T + 1, 8, 32, 2048, 768, "bf16"), MoEConfig)
    assert isinstance(pick_config(DIRECT_MAX_N // 2, 2, 4, 4096, 14336, "bf16"), DirectConfig)
    assert isinstance(pick_config(DIRECT_MAX_N // 2 + 1, 2, 4, 4096, 14336, "int8"), MoEConfig)


def test_expert_without_tokens(run_case):
    # Every token goes to experts 0 and 1 only: the slots of experts 2..7 get nothing.
    ids = [[0, 1] if j % 2 else [1, 0] for j in range(9)]
    run_case(_cases.routed_case, ids, [2, 0, 1, 3, 4, 5, 6, 7], 64, 32, 7)


def test_skipped_and_cpu_only_tokens_give_zeros(run_case):
    # Token 0: all ids -1; token 1: only CPU experts; token 2: one GPU expert.
    out = run_case(_cases.routed_case, [[-1, -1], [1, 2], [1, 0]], [0, -1, -1, 1], 64, 32, 5)
    assert torch.equal(out[:2], torch.zeros(2, 64)) and out[2].abs().sum() > 0


def test_all_ids_skipped_gives_zeros(run_case):
    out = run_case(_cases.routed_case, [[-1, -1]] * 7, [0, 1, -1], 64, 32, 1)
    assert torch.equal(out, torch.zeros(7, 64))


def test_no_slots_gives_zeros(run_case):
    out = run_case(_cases.routed_case, [[0, 1]] * 5, [-1, -1], 64, 32, 2)
    assert torch.equal(out, torch.zeros(5, 64))


def test_cpu_tensors_without_interpreter_is_a_clear_error():
    # In a fresh process without TRITON_INTERPRET: triton must not be imported in this one.
    code = ("import torch\nfrom kt.gpu_ops import fused_moe\n"
            "try:\n    fused_moe(torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),"
            " torch.zeros(1, dtype=torch.int32), torch.randn(1, 64, 64), torch.randn(1, 64, 32))\n"
            "except RuntimeError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if "CUDA" in r.stdout and "cannot take" in r.stdout:
        pytest.fail(r.stdout)
    assert "ERR fused_moe: CPU tensors need the Triton interpreter" in r.stdout, r.stdout + r.stderr


ALIGN_PATHS = ["per_slot", "one_program", "two_launch", "atomics"]


# larger N: several programs per launch, many slots (one-hot tiles of 8 rows on the two-launch path),
# and (big-chunks) four sub-chunks per program
E2S_MANY = [(i * 7) % 301 - 1 for i in range(320)]  # slots 0..299 and some -1, scattered


@pytest.mark.parametrize("path", ALIGN_PATHS)
@pytest.mark.parametrize("t,k,e2s,bm", [(1, 2, E2S_A, 16), (37, 3, E2S_B, 16), (33, 4, E2S_A, 32),
                                      (0, 2, E2S_A, 16), (5, 2, [-1, -1, -1], 16), (128, 8, E2S_MANY, 16)])
def test_align_by_slot(run_case, t, k, e2s, bm, path):
    run_case(_cases.align_case, t, k, e2s, bm, t + k + bm, path)


@pytest.mark.parametrize("path", ["per_slot"] + ALIGN_PATHS[2:])
@pytest.mark.parametrize("t,k,e2s,bm", [(300, 4, E2S_B, 16), (157, 3, E2S_MANY, 32), (9000, 8, E2S_A, 64)],
                         ids=["chunks", "many-slots", "big-chunks"])
def test_align_by_slot_large_n(run_case, t, k, e2s, bm, path):
    run_case(_cases.align_case, t, k, e2s, bm, t + k + bm, path)


@pytest.mark.parametrize("t,k,e2s,chunk", [(37, 3, E2S_B, 16), (64, 3, E2S_MANY, 64), (40, 2, E2S_A, 32)])
def test_align_per_slot_in_steps(run_case, t, k, e2s, chunk):
    # the per-slot path's programs map the ids `chunk` at a time (two passes), a partial last step
    run_case(_cases.align_case, t, k, e2s, 16, t + k, "per_slot", chunk)


@pytest.mark.parametrize("t,k,h,block_h,ydtype", [(7, 3, 100, 32, "fp32"), (9, 2, 64, 1024, "bf16"),
                                                  (5, 8, 48, 16, "fp32")])
def test_combine(run_case, t, k, h, block_h, ydtype):
    run_case(_cases.combine_case, t, k, h, block_h, ydtype, t + k + h)


@pytest.mark.parametrize("t,k,h,i,int8w,config", [
    # down_block_k < I (several steps, pipelined or not), a masked tail of I, narrow and odd-tailed
    # column blocks, top-k 2 and 4
    (3, 2, 48, 80, True, dict(down_block_n=4, down_block_k=32, down_num_stages=3)),
    (4, 4, 40, 64, False, dict(down_block_n=16, down_block_k=16, down_num_stages=1)),
    (2, 4, 64, 48, True, dict(down_block_n=2, down_block_k=64, down_num_stages=5)),
])
def test_direct_down_skips_off_gpu_rows(run_case, t, k, h, i, int8w, config):
    run_case(_cases.direct_down_case, t, k, h, i, int8w, config, 50 + t + k)


@pytest.mark.parametrize("a8", [True, False], ids=["a8", "bf16-activations"])
def test_nan_in_a_token_makes_its_row_nan(run_case, a8):
    run_case(_cases.nan_row_case, a8, 11)


@pytest.mark.parametrize("path", ALIGN_PATHS[2:])
def test_fused_moe_large_n_alignment(run_case, path):
    # Large-N alignment path (forced on a small case) feeding the GEMMs.
    run_case(_cases.fused_case, 33, 8, 4, 64, 32, E2S_B, "bf16", 5, 0.1, None, path)


def _args(device="cpu", t=3, k=2, h=64, i=32, s=2, e=4):
    return dict(x=torch.randn(t, h), topk_ids=torch.zeros(t, k, dtype=torch.int64),
                topk_weights=torch.rand(t, k), expert_to_slot=torch.tensor([0, 1, -1, -1][:e], dtype=torch.int32),
                w13=torch.randn(s, 2 * i, h), w2=torch.randn(s, h, i))


@pytest.mark.parametrize("change,exc,match", [
    (dict(x=torch.randn(3, 64, 1)), ValueError, "x must be"),
    (dict(x=torch.randn(3, 64).to(torch.int32)), ValueError, "x must be"),
    (dict(topk_ids=torch.zeros(3, 2)), ValueError, "topk_ids"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), ValueError, "topk_ids"),
    (dict(topk_weights=torch.rand(3, 3)), ValueError, "topk_weights"),
    (dict(expert_to_slot=torch.zeros(4)), ValueError, "expert_to_slot"),
    (dict(w13=torch.randn(2, 64, 32)), ValueError, "w13"),
    (dict(w13=torch.randn(2, 63, 64)), ValueError, "w13"),
    (dict(w2=torch.randn(2, 64, 16)), ValueError, "w2"),
    (dict(w2=torch.randn(2, 64, 32).to(torch.bfloat16)), ValueError, "share a dtype"),
    (dict(w13=torch.zeros(2, 64, 64, dtype=torch.int8), w2=torch.zeros(2, 64, 32, dtype=torch.int8)),
     ValueError, "int8 weights need"),
    (dict(w13_scale=torch.ones(2, 64)), ValueError, "only for int8"),
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input(change, exc, match):
    args = _args()
    args.update(change)
    with pytest.raises(exc, match=match):
        fused_moe(args.pop("x"), args.pop("topk_ids"), args.pop("topk_weights"), args.pop("expert_to_slot"),
                  args.pop("w13"), args.pop("w2"), **args)


def test_bad_int8_scales():
    a = _args()
    w13 = torch.zeros(2, 64, 64, dtype=torch.int8)
    w2 = torch.zeros(2, 64, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="w13_scale must be"):
        fused_moe(a["x"], a["topk_ids"], a["topk_weights"], a["expert_to_slot"], w13, w2,
                  w13_scale=torch.ones(2, 32), w2_scale=torch.ones(2, 64))
    with pytest.raises(ValueError, match="w2_scale must be"):
        fused_moe(a["x"], a["topk_ids"], a["topk_weights"], a["expert_to_slot"], w13, w2,
                  w13_scale=torch.ones(2, 64), w2_scale=torch.ones(2, 64, dtype=torch.float64))


def test_bad_config():
    a = _args()
    with pytest.raises(TypeError, match="config must be a MoEConfig or DirectConfig"):
        fused_moe(a["x"], a["topk_ids"], a["topk_weights"], a["expert_to_slot"], a["w13"], a["w2"],
                  config={"block_m": 16})


def test_expert_too_large_for_32_bit_offsets():
    # Offsets inside one expert are 32-bit in the kernels: an expert spanning 2**31 elements is refused
    # (meta tensors: nothing is allocated).
    h, i = 2 ** 20, 2 ** 11
    x = torch.empty(1, h, device="meta")
    ids = torch.zeros(1, 1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"one expert of w13 spans .* fewer than 2\*\*31"):
        fused_moe(x, ids, torch.ones(1, 1, device="meta"), torch.zeros(1, dtype=torch.int32, device="meta"),
                  torch.empty(1, 2 * i, h, device="meta"), torch.empty(1, h, i, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graph capture)")
def test_a8_graph_replay_is_bit_identical_to_eager():
    """The a8 path (quantiser, int8 tensor cores; N=600, so the per-slot alignment), captured in a
    CUDA graph and replayed with new inputs copied in, equals eager mode bit for bit."""
    from kt.gpu_ops import MoEConfig

    g = torch.Generator().manual_seed(5)
    t, e, k, h, i = 300, 8, 2, 256, 128
    e2s = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device="cuda")
    w13 = torch.randint(-127, 128, (6, 2 * i, h), generator=g, dtype=torch.int8).cuda()
    w2 = torch.randint(-127, 128, (6, h, i), generator=g, dtype=torch.int8).cuda()
    s13 = (torch.rand(6, 2 * i, generator=g) / 127 / h ** 0.5).cuda()
    s2 = (torch.rand(6, h, generator=g) / 127 / i ** 0.5).cuda()
    cfg = MoEConfig(block_m=64, block_n=64, block_k=64, a8=True)

    def inputs(seed):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(t, h, generator=gg).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(e, generator=gg)[:k] for _ in range(t)]).cuda()
        return x, ids, torch.rand(t, k, generator=gg).cuda()

    def run(x, ids, w):
        return fused_moe(x, ids, w, e2s, w13, w2, w13_scale=s13, w2_scale=s2, config=cfg)

    static = inputs(1)
    run(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*static)
    for seed in (2, 3):
        new = inputs(seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(*new))
