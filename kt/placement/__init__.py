"""kt.placement."""
