"""kt.sglang_hook."""
