"""Triton kernels that sort a layer's token-slots by GPU expert slot (the fused MoE's alignment
step; kt/gpu_ops/moe.py's ``align_by_slot`` picks the path and launches them).

Legend: T tokens, K top-k, E experts, S GPU expert slots, N = T*K token-slots. Output: ``sorted_ids``
(token-slots grouped by slot into blocks of ALIGN_M rows, padded with the sentinel N),
``block_slot`` (each block's slot) and ``num_padded[0]`` (rows in use); see kt/gpu_ops/_kernels.py.
"""
import triton
import triton.language as tl


# ----------------------------------------------------------------------------- slot alignment
# Large N with more than 64 slots (align_by_slot picks the path): after zeroing the counters, three
# launches, no host sync: count token-slots per slot (atomics), prefix-sum the padded counts in one
# program (also writes each block's slot and the sentinel everywhere), scatter each token-slot to its
# slot's next free row (atomics). The one-program path (small N) runs the same steps in one launch.
# The order of rows inside a slot is not fixed, which changes no result: each row's dot products do
# not depend on the other rows of its tile.

@triton.jit
def _slot_map(ids_ptr, e2s_ptr, offs, N, E, S):
    """expert_to_slot[ids[n]] for the token-slots offs (-1 for an id of -1 or outside [0, E), a slot
    outside [0, S), or n >= N)."""
    m = offs < N
    e = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    ok = m & (e >= 0) & (e < E)
    s = tl.load(e2s_ptr + tl.where(ok, e, 0), mask=ok, other=-1).to(tl.int32)
    return tl.where((s >= 0) & (s < S), s, -1)


@triton.jit
def _slots_of(ids_ptr, e2s_ptr, slot_ptr, offs, N, E, S):
    """slot[n] = _slot_map(...) for the token-slots offs, stored and returned."""
    s = _slot_map(ids_ptr, e2s_ptr, offs, N, E, S)
    tl.store(slot_ptr + offs, s, mask=offs < N)
    return s


@triton.jit
def _count_chunk(ids_ptr, e2s_ptr, slot_ptr, counts_ptr, offs, N, E, S, BLOCK: tl.constexpr):
    s = _slots_of(ids_ptr, e2s_ptr, slot_ptr, offs, N, E, S)
    on = (offs < N) & (s >= 0)
    tl.atomic_add(counts_ptr + tl.where(on, s, 0), tl.full((BLOCK,), 1, tl.int32), mask=on)


@triton.jit
def _offsets(counts_ptr, cursor_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr,
             N, S, P, SP2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    offs_s = tl.arange(0, SP2)
    ms = offs_s < S
    c = tl.load(counts_ptr + offs_s, mask=ms, other=0, volatile=True)
    padded = (c + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + offs_s, end - padded, mask=ms)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    block_end = tl.where(ms, end // BLOCK_M, 2147483647)
    nb = P // BLOCK_M
    for b0 in range(0, nb, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        slot_of_b = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(block_slot_ptr + b, tl.minimum(slot_of_b, S - 1), mask=b < nb)
    for p0 in range(0, P, FILL):  # (in chunks of 64 this loop took ~9 us of the 28 at N = 32768)
        p = p0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + p, tl.full((FILL,), 0, tl.int32) + N, mask=p < P)


@triton.jit
def _scatter_chunk(slot_ptr, cursor_ptr, sorted_ids_ptr, offs, N, BLOCK: tl.constexpr):
    m = offs < N
    s = tl.load(slot_ptr + offs, mask=m, other=-1, volatile=True)
    on = m & (s >= 0)
    pos = tl.atomic_add(cursor_ptr + tl.where(on, s, 0), tl.full((BLOCK,), 1, tl.int32), mask=on)
    tl.store(sorted_ids_ptr + tl.where(on, pos, 0), offs, mask=on)


@triton.jit
def slot_count_kernel(ids_ptr, e2s_ptr, slot_ptr, counts_ptr, N, E, S, BLOCK: tl.constexpr):
    """slot[n] = expert_to_slot[ids[n]] (-1 when the id is -1 / out of [0, E) or the slot is out of
    [0, S)); counts[s] += number of token-slots of slot s. ids [N] int; e2s [E] int32; slot [N] int32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _count_chunk(ids_ptr, e2s_ptr, slot_ptr, counts_ptr, offs, N, E, S, BLOCK)


@triton.jit
def slot_offsets_kernel(counts_ptr, cursor_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr,
                        N, S, P, SP2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        FILL: tl.constexpr):
    """One program. cursor[s] = first row of slot s (each slot's rows padded to BLOCK_M);
    num_padded[0] = rows in use; block_slot[b] = slot of row block b; sorted_ids[:] = N (sentinel)."""
    _offsets(counts_ptr, cursor_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr, N, S, P, SP2, BLOCK_M, CHUNK,
             FILL)


@triton.jit
def slot_scatter_kernel(slot_ptr, cursor_ptr, sorted_ids_ptr, N, BLOCK: tl.constexpr):
    """sorted_ids[cursor[slot[n]]++] = n for every token-slot n on the GPU."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _scatter_chunk(slot_ptr, cursor_ptr, sorted_ids_ptr, offs, N, BLOCK)


# Two launches, no atomics, no zeroing (large N with up to 64 slots): each program of
# slot_hist_kernel maps its NSUB * SUB token-slots to their slots and stores their per-slot counts
# (hist [C, SP2]); each program of slot_place_kernel reads all of hist (a few KB: every program
# does the same prefix sums, so no one-program step sits between the launches), places its own
# token-slots after those of the earlier programs (a rank inside its chunk from a one-hot running
# sum), and writes its share of block_slot and of the padding rows. The order of rows inside a slot
# is token order, so the layout is deterministic. (The one-hot work grows with the slots: with 128
# the four-launch path above is faster.)

@triton.jit
def slot_hist_kernel(ids_ptr, e2s_ptr, slot_ptr, hist_ptr, N, E, S,
                     NSUB: tl.constexpr, SUB: tl.constexpr, SP2: tl.constexpr):
    """slot[n] = expert_to_slot[ids[n]] (-1 as _slots_of) for this program's NSUB * SUB
    token-slots; hist[pid, s] = how many of them have slot s. ids [N] int; e2s [E] int32; hist [C, SP2]
    int32. (The sub-chunk loop is unrolled so that all its loads go out together.)"""
    pid = tl.program_id(0)
    lanes = tl.arange(0, SP2)
    count = tl.zeros((SP2,), tl.int32)
    for j in tl.static_range(NSUB):
        s = _slots_of(ids_ptr, e2s_ptr, slot_ptr, (pid * NSUB + j) * SUB + tl.arange(0, SUB), N, E, S)
        count += tl.sum((s[:, None] == lanes[None, :]).to(tl.int32), 0)
    tl.store(hist_ptr + pid * SP2 + lanes, count)


@triton.jit
def slot_place_kernel(slot_ptr, hist_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr, N, S, C, P,
                      NSUB: tl.constexpr, SUB: tl.constexpr, SP2: tl.constexpr, CB: tl.constexpr,
                      BLOCK_M: tl.constexpr, BCHUNK: tl.constexpr):
    """sorted_ids: each slot's token-slots in token order from the slot's first row (slots one after
    another, each padded to a multiple of BLOCK_M with the sentinel N); num_padded[0] = rows in use;
    block_slot[b] = slot of row block b (S - 1 past the rows in use). Rows from num_padded[0] on are
    not written. C = programs of slot_hist_kernel (and of this kernel); P = rows of sorted_ids."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, SP2)
    total = tl.zeros((SP2,), tl.int32)
    before = tl.zeros((SP2,), tl.int32)
    for c0 in range(0, C, CB):
        cc = c0 + tl.arange(0, CB)
        blk = tl.load(hist_ptr + cc[:, None] * SP2 + lanes[None, :], mask=(cc < C)[:, None], other=0)
        total += tl.sum(blk, 0)
        before += tl.sum(tl.where((cc < pid)[:, None], blk, 0), 0)
    padded = (total + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    # this chunk's token-slots, in order, after the earlier chunks' rows of their slot
    base = start + before
    for j in tl.static_range(NSUB):
        offs = (pid * NSUB + j) * SUB + tl.arange(0, SUB)
        s = tl.load(slot_ptr + offs, mask=offs < N, other=-1)
        hot = (s[:, None] == lanes[None, :]).to(tl.int32)
        rank = tl.sum(hot * (tl.cumsum(hot, 0) - 1 + base[None, :]), 1)
        tl.store(sorted_ids_ptr + tl.where(s >= 0, rank, 0), offs, mask=s >= 0)
        base += tl.sum(hot, 0)
    # this program's share of block_slot (blocks pid*BCHUNK, ... strided by C*BCHUNK)
    nb = P // BLOCK_M
    block_end = tl.where(lanes < S, end // BLOCK_M, 2147483647)
    for b0 in range(pid * BCHUNK, nb, C * BCHUNK):
        b = b0 + tl.arange(0, BCHUNK)
        slot_of_b = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(block_slot_ptr + b, tl.minimum(slot_of_b, S - 1), mask=b < nb)
    # and of the padding rows (slots pid, pid + C, ...)
    r = tl.arange(0, BLOCK_M)
    for sl in range(pid, S, C):
        first = tl.sum(tl.where(lanes == sl, start + total, 0), 0)
        last = tl.sum(tl.where(lanes == sl, end, 0), 0)
        tl.store(sorted_ids_ptr + first + r, tl.full((BLOCK_M,), 0, tl.int32) + N, mask=first + r < last)


@triton.jit
def align_small_kernel(ids_ptr, e2s_ptr, slot_ptr, counts_ptr, cursor_ptr, block_slot_ptr, num_padded_ptr,
                       sorted_ids_ptr, N, E, S, P, SP2: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """The three alignment steps in one program (one launch, for small N, e.g. decode), separated by
    barriers; also zeroes counts itself. Flags and counters written by atomics are read back with
    volatile loads."""
    offs_s = tl.arange(0, SP2)
    tl.store(counts_ptr + offs_s, tl.zeros((SP2,), tl.int32))
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK):
        _count_chunk(ids_ptr, e2s_ptr, slot_ptr, counts_ptr, n0 + tl.arange(0, BLOCK), N, E, S, BLOCK)
    tl.debug_barrier()
    _offsets(counts_ptr, cursor_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr, N, S, P, SP2, BLOCK_M, CHUNK,
             FILL)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK):
        _scatter_chunk(slot_ptr, cursor_ptr, sorted_ids_ptr, n0 + tl.arange(0, BLOCK), N, BLOCK)


@triton.jit
def align_per_slot_kernel(ids_ptr, e2s_ptr, slot_ptr, block_slot_ptr, num_padded_ptr, sorted_ids_ptr, N, E, S,
                          CHUNK: tl.constexpr, SINGLE: tl.constexpr, SP2: tl.constexpr, BLOCK_M: tl.constexpr,
                          BCHUNK: tl.constexpr):
    """The alignment with one program per slot s = program_id(0), in one launch, no atomics, no
    barriers: every program maps all N ids to their slots and counts each slot's token-slots (a
    histogram per CHUNK ids), so each knows where every slot's rows start; program s then writes its
    own: its token-slots in token order (ranked by a running sum), its padding rows (the sentinel N),
    its row blocks' block_slot entries. Program 0 also writes slot [N] and num_padded. Rows and
    blocks from num_padded[0] on are not written. SINGLE (N <= CHUNK): the ids are read once, else
    once per pass. SP2: a power of two >= S."""
    me = tl.program_id(0)
    lanes = tl.arange(0, 2 * SP2)
    if SINGLE:
        offs = tl.arange(0, CHUNK)
        s = _slot_map(ids_ptr, e2s_ptr, offs, N, E, S)
        counts = tl.histogram(tl.where(s >= 0, s, SP2), 2 * SP2)  # (token-slots off the GPU: bin SP2)
        if me == 0:
            tl.store(slot_ptr + offs, s, mask=offs < N)
    else:
        counts = tl.zeros((2 * SP2,), tl.int32)
        for c0 in range(0, N, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            s = _slot_map(ids_ptr, e2s_ptr, offs, N, E, S)
            counts += tl.histogram(tl.where(s >= 0, s, SP2), 2 * SP2)
            if me == 0:
                tl.store(slot_ptr + offs, s, mask=offs < N)
    counts = tl.where(lanes < S, counts, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, 0) - padded
    first = tl.sum(tl.where(lanes == me, start, 0), 0)
    count = tl.sum(tl.where(lanes == me, counts, 0), 0)
    rows = tl.sum(tl.where(lanes == me, padded, 0), 0)
    if me == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    if SINGLE:
        mine = s == me
        tl.store(sorted_ids_ptr + first + tl.cumsum(mine.to(tl.int32), 0) - 1, offs, mask=mine)
    else:
        base = first
        for c0 in range(0, N, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            mine = _slot_map(ids_ptr, e2s_ptr, offs, N, E, S) == me
            tl.store(sorted_ids_ptr + base + tl.cumsum(mine.to(tl.int32), 0) - 1, offs, mask=mine)
            base += tl.sum(mine.to(tl.int32), 0)
    r = tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + first + count + r, tl.full((BLOCK_M,), 0, tl.int32) + N, mask=count + r < rows)
    blocks = rows // BLOCK_M
    for b0 in range(0, blocks, BCHUNK):
        b = b0 + tl.arange(0, BCHUNK)
        tl.store(block_slot_ptr + first // BLOCK_M + b, tl.full((BCHUNK,), 0, tl.int32) + me, mask=b < blocks)
