"""kt.cli."""
