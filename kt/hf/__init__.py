"""kt.hf."""
