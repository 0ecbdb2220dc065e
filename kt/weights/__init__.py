"""kt.weights."""
