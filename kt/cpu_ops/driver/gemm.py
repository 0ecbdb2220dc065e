"""The driver's GEMM calls (jitted): an expert's gate+up or down kernel on gathered rows, called
through its entry point in the descriptor (``runtime.native.icall8`` / ``icall5``: the kernel's
IR is never linked and code-generated again here).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import cache as _cache
from ..runtime.job import SLOT, array2, array4, array5, participant_rows, rows, seg
from ..runtime.native import icall5, icall8
from .layout import (A_GUS, A_W13D, A_W13R, A_W13S, A_W13W, A_W2D, A_W2R, A_W2S, A_W2W, A_XGS,
                     A_XSS, D_KM13, D_KM2, D_KV13, D_KV2, S_GCH, S_GS13, S_GS2, S_GUS, S_I,
                     S_TABM, S_UPOFF, SCHEME_INT4, SCHEME_INT8)
from .profile import BUSY, book
from .rows import _act_rows, _gather_rows

_cache.install()


@njit(nogil=True, cache=True)
def load_w_int8(desc, sd, ss, sw, e):
    return (array5(desc, sd, np.int8)[e], array2(desc, ss, np.float32)[e],
            array2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def load_w_int4(desc, sd, ss, sw, e):
    return (array5(desc, sd, np.uint8)[e], array4(desc, ss, np.float32)[e],
            array2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def load_w_bf16(desc, sd, ss, sw, e):
    return (array5(desc, sd, np.uint16)[e], array2(desc, ss, np.float32)[e],
            array2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def _gemm_call(desc, scheme, which, e, xa, xs, out, nb0, nb1, small):
    """Expert e's gate+up (which=0: w13) or down (which=1: w2) kernel on activation rows xa
    (int8 [M, D] bytes; bf16 rows as byte pairs) with scales xs [M] into out [M, N] fp32,
    blocks [nb0, nb1); small: the small-M kernel."""
    if which == 0:
        sd, sc, sw, gs = A_W13D, A_W13S, A_W13W, desc[S_GS13]
        av, am = desc[D_KV13], desc[D_KM13]
    else:
        sd, sc, sw, gs = A_W2D, A_W2S, A_W2W, desc[S_GS2]
        av, am = desc[D_KV2], desc[D_KM2]
    addr = av if small else am
    if scheme == SCHEME_INT8:
        d, s, w = load_w_int8(desc, sd, sc, sw, e)
        icall8(addr, xa, xs, d, s, w, out, nb0, nb1)
    elif scheme == SCHEME_INT4:
        st = A_W13R if which == 0 else A_W2R
        if desc[st * SLOT] != 0 and (small or desc[S_TABM] != 0):
            sc = st
        d, s, w = load_w_int4(desc, sd, sc, sw, e)
        icall8(addr, xa, xs, d, s, gs, out, nb0, nb1)
    else:
        d, s, w = load_w_bf16(desc, sd, sc, sw, e)
        icall5(addr, xa.view(np.uint16), d, out, nb0, nb1)


@njit(nogil=True, cache=True)
def _gate_up(desc, scheme, me, e, r0, r1, nb0, nb1, small, whole, xg, xs, rslot, K, R, gu,
             hq, hs, h, bf16, prof, on, t):
    """Phase 2 for expert e's gathered rows [r0, r1), blocks [nb0, nb1): in calls of at most
    S_GCH rows, each on its rows' activations gathered into the participant's A_XGS / A_XSS.
    whole (a task of all blocks): each call's activations follow at once, from the
    participant's A_GUS rows when it has them (the gate+up outputs never leave this core's
    cache), else from the shared gu rows; a profile (``on``) books them under phase 3. Returns
    the clock of ``profile.book``."""
    gch = desc[S_GCH]
    gus_rows = desc[S_GUS]
    xbytes = xg.shape[1]
    n13 = gu.shape[1]
    I = desc[S_I]
    up_off = desc[S_UPOFF]
    xga = participant_rows(desc, A_XGS, me, gch, xbytes, np.int8)
    xsa = participant_rows(desc, A_XSS, me, 1, gch, np.float32)[0]
    for a0 in range(r0, r1, gch):
        a1 = min(r1, a0 + gch)
        m = a1 - a0
        _gather_rows(xg, xs, rslot, K, R, a0, a1, xga, xsa)
        own = whole and m <= gus_rows
        out = (rows(participant_rows(desc, A_GUS, me, gus_rows, n13, np.float32), 0, m, np.float32) if own
               else rows(gu, a0, a1, np.float32))
        _gemm_call(desc, scheme, 0, e, rows(xga, 0, m, np.int8), seg(xsa, 0, m, np.float32),
                   out, nb0, nb1, small)
        if whole:
            t = book(prof, on, 2, BUSY, t)
            _act_rows(out, 0, m, I, up_off, hq, hs, h, bf16, R, a0)
            t = book(prof, on, 3, BUSY, t)
    return t


@njit(nogil=True, cache=True)
def _down_rows(desc, scheme, e, r0, r1, nb0, nb1, small, hq, hs, y):
    """Expert e's down GEMM of gathered rows [r0, r1), blocks [nb0, nb1), into y's rows."""
    _gemm_call(desc, scheme, 1, e, rows(hq, r0, r1, np.int8), seg(hs, r0, r1, np.float32),
               rows(y, r0, r1, np.float32), nb0, nb1, small)
