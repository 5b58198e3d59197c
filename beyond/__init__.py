"""Beyond the paper: opt-in decoding rules a reader of the paper does not need (relaxed.py: lossy; stream.py:
lossless)."""
