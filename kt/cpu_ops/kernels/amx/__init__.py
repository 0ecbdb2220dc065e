"""AMX kernels (AMX-INT8 / AMX-BF16 tiles), one file per scheme: ``int8``, ``int4``, ``bf16``;
``_tiles`` holds what they share, ``_intrinsics`` the tile instructions, ``roofline`` the
tile-resident peak loops.

Importing this package imports none of them: each kernel file raises
``isa.UnsupportedVariantError`` at import unless this process may run AMX code
(``_intrinsics.require_amx``), and the registry imports them only for a host that does.
"""
