"""Triton GEMM kernels for :mod:`lowbit.gemm` (imported only where Triton is installed)."""
