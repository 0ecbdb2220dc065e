"""Which SGLang releases kt's plugin supports, read without importing SGLang."""
from __future__ import annotations

import re

__all__ = ["SUPPORTED_SGLANG", "sglang_version", "is_supported"]

# SGLang releases kt's plugin was written and tested against (post releases of these included).
# The hook points (ServerArgs.add_cli_args / from_cli_args, kt_ep_wrapper.KTEPWrapperMethod and
# create_kt_config_from_server_args, FusedMoE._weight_loader_impl) are private to SGLang and move
# between releases, so a new release must be checked before it is added here.
SUPPORTED_SGLANG = ("0.5.23",)


def sglang_version() -> str | None:
    """The installed SGLang's version (from its package metadata, without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def is_supported(version: str | None) -> bool:
    """True when ``version`` is one of SUPPORTED_SGLANG (ignoring post/dev/local suffixes)."""
    if not version:
        return False
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return bool(m) and ".".join(m.groups()) in SUPPORTED_SGLANG
