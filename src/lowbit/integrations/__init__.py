"""lowbit inside other libraries: :mod:`lowbit.integrations.transformers` (HF transformers' attention interface).

Each integration imports its library when it is used, not when it is imported.
"""

__all__ = ["transformers"]
