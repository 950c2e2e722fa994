"""lowbit.runtime: what every kernel launcher shares, below every other layer.

* :mod:`~lowbit.runtime.env`: the ``LOWBIT_*`` switches, declared once (``lowbit info`` lists them);
* :mod:`~lowbit.runtime.device`: the interpreter flag and cached device facts (capability, SM count);
* :mod:`~lowbit.runtime.launch`: relaunching compiled Triton kernels without per-call argument binding;
* :mod:`~lowbit.runtime.autotune`: the shared autotuner (``tuned_launch``);
* :mod:`~lowbit.runtime.amax_arena`: amax accumulators of a captured CUDA graph from one buffer;
* :mod:`~lowbit.runtime.transpose`: ``x.t().contiguous()`` as one tiled kernel;
* :mod:`~lowbit.runtime.log`: the ``lowbit`` logger and why a fast path declined a call;
* :mod:`~lowbit.runtime.callable`: modules that are also their function (``lowbit.attention(...)``).

Nothing here imports any other part of lowbit.
"""
