"""The ISA-agnostic MoE expert driver (jitted code only; the Python API is ``moe.CPUMoE``).

One job computes, for tokens [0, T) of x [T, H]:
    out[t] (+)= sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t,k] on the CPU.
It runs on every participant of a CpuPool job, in chunks of at most C tokens, each chunk in six
phases separated by task-counting barriers (a phase ends when all its tasks are done, whoever ran
them, so threads may join late):
    0 plan      (1 task)       bucket the chunk's (token, slot) pairs by expert -> rows of the
                               gathered buffers; list the (expert, row-block range) tasks
    1 quantise  (token blocks) x -> int8 + per-token scale (or bf16), once per token with a
                               CPU slot (R rows: two-level activations have two)
    2 gate+up   (dynamic)      gu[rows of e] = xq[tokens of e's rows] @ w13[e]^T   [T_e, 2I] fp32,
                               the rows' activations gathered into the participant's scratch
                               per kernel call (at most "gch" rows)
    3 act       (row blocks)   h = silu(gate) * up, requantised per row (or bf16-rounded)
    4 down      (dynamic)      y[rows of e] = hq[rows of e] @ w2[e]^T     [T_e, H] fp32
    5 combine   (token blocks) out[t] = (out[t] if incremental) + sum_k w[t,k] * y[row(t,k)]
A stream-gated job ("gate" word != 0: the decode path of a hybrid layer) is published before its
inputs exist: its participants spin at entry until a CUDA stream sets the int32 "start" flag (after
copying the inputs into pinned memory), and the first participant to finish clears "start" and sets
"done", so no Python runs between the stream reaching the CPU part and the stream going on.
Tasks of phases 2 and 4 are (expert, row-block range) pairs, biggest experts first; their size is
a pure function of the work and the thread count (``plan._blocks_per_task``): in decode each expert's
rows are split over the threads, in prefill whole experts are handed out dynamically. When every
task is a whole expert ("fused", prefill), a phase-2 task runs the expert's gate+up, activations
and down back to back (its rows stay in that core's caches: the gate+up outputs go to the
participant's own scratch when its "gus" rows hold them, so they never reach memory) and phases 3 and
4 have no tasks; a chunk of at most TOKEN_BLOCK tokens is quantised by the plan task (one barrier
less in decode).
Pipelined decode (the "pipe" word, tasks split within experts and every expert's activations
small, <= PIPE_ACT_MAX elements): phase 2 lists the gate+up tasks and then the down tasks, and phases 3 and
4 have none; the participant finishing an expert's last gate+up task computes its activations and
marks it ready (per-expert words in "dep"), and a down task waits only for its own expert. Two
all-thread barriers (and the waits of threads idle behind the slowest gate+up and act tasks) go,
and down tasks stream weights while other experts' gate+up tasks are still running.
A fused chunk runs its last "tail" experts (the smallest, taken last) in the same pipelined order:
split into gate+up and down part tasks (about "tailp" and "tailp" / 2 of them) listed after the
whole experts, so the threads run out of work closer together than one whole expert apart.

The GEMM micro-kernels (kt/cpu_ops/README.md contract) reach this code as addresses of their
compiled entry points in the descriptor (``runtime.native.icall8`` / ``icall5``: an indirect call,
so their IR is never linked and code-generated again here), and arrays as raw addresses and
shapes (``runtime.job``), so the job is compiled once (and cached on disk), and the pool's worker
loop never needs the GIL.

Files: ``layout`` (the descriptor of the job, and the per-call writer), ``job`` (the job loop and
one function per phase), ``plan``, ``rows`` (quantise, activations, combine), ``gemm`` (the kernel
calls), ``sync`` (barriers, the stream gate), ``profile`` (the one timing helper). Importing this
package imports none of them.
"""
