"""Ragged paged attention: queries ragged over sequences (cumulative query lengths), K/V read from the paged cache
in place. `reference.py` defines what every kernel computes; the Pallas kernels for TPU (Mosaic) and GPU sit beside it."""
