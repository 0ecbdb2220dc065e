"""kt.sglang_hook: the SGLang plugin. ``--kt-*`` flags on upstream SGLang (no fork), and kt's MoE
method inside SGLang's ``FusedMoE``.

SGLang calls ``plugin()`` (entry point ``kt`` in the group ``sglang.srt.plugins``) early in every
process it starts: launcher, scheduler, detokenizer, data-parallel workers. ``plugin()`` checks the
installed SGLang version first; only a supported version is patched (through SGLang's own
``HookRegistry``). Anything else logs one message and leaves SGLang untouched.

This is the only kt package that imports sglang, and it does so only inside ``plugin()``:
``import kt.sglang_hook`` itself imports nothing from SGLang.
"""
from __future__ import annotations

import logging

from ._support import SUPPORTED_SGLANG, is_supported, sglang_version

__all__ = ["plugin", "SUPPORTED_SGLANG", "sglang_version", "is_supported"]

logger = logging.getLogger("kt.sglang_hook")

_installed = False


def plugin() -> None:
    """SGLang's entry point: install kt's hooks when the SGLang version is supported."""
    global _installed
    if _installed:
        return
    v = sglang_version()
    if not is_supported(v):
        logger.warning(
            "kt: SGLang %s is not supported by kt's SGLang plugin (supported: %s); kt leaves SGLang "
            "untouched (no --kt-* extensions, upstream's KT path unchanged). Install a supported "
            "version, e.g. pip install 'sglang==%s'.", v, ", ".join(SUPPORTED_SGLANG), SUPPORTED_SGLANG[-1])
        return
    from ._hooks import install

    install()
    _installed = True
