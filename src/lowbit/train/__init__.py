"""Training: data (:mod:`.data`), the loop (:mod:`.loop`), checkpoints, reports, ``lowbit train`` and ``lowbit
demo``."""

from .loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
