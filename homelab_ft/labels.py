"""The label convention every stage shares, torch-free: data writes it, the losses skip it, and the
export's quality report reads it."""

IGNORE_INDEX = -100
"""Label of a position without loss (transformers' and PyTorch's cross-entropy convention)."""
