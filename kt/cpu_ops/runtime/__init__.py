"""The native runtime: code that runs without the GIL, and the pool that runs it.

``atomics`` (atomic words, flags, spin waits, the time-stamp counter), ``native`` (calls between
compiled functions by address), ``worker`` (the job-control words and the nogil worker loop),
``job`` (the job descriptor: layouts and the one builder every descriptor is written with) and
``pool`` (``CpuPool``, ``default_pool``). Importing this package imports none of them.
"""
