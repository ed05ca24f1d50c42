"""Sequence-mixing operators in pure PyTorch (Gated DeltaNet and its short convolution)."""
