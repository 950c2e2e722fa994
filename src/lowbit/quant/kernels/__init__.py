"""Triton kernels for :mod:`lowbit.quant` (imported only where Triton is installed)."""
