"""Optimizers that know about lowbit's quantized weights.

* :class:`AdamW`: ``torch.optim.AdamW`` (fused) whose step also writes the FP8 copies of the 128 x 128 blockwise
  weights, so the next forward does not quantize them again (:mod:`lowbit.optim.adamw`).
"""

from .adamw import AdamW

__all__ = ["AdamW"]
