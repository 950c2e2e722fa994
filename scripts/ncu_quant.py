"""One 1x128 row+col quantize of a BF16 input under a forced launch candidate, for Nsight Compute (diagnostic).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        -k regex:rowcol python scripts/ncu_quant.py 8192x8192 '{"KIND": "gluon", "SR": 32, "RPT": 4, "STAGES": 2, "CTAS": 2, "num_warps": 4}'
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from lowbit.quant import Float8Blockwise  # noqa: E402
from quant_blockwise_sweep import prepared  # noqa: E402

M, K = (int(v) for v in sys.argv[1].split("x"))
cfg = json.loads(sys.argv[2])
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
launch, _ = prepared(x, Float8Blockwise(), True, True, cfg)
launch()
torch.cuda.synchronize()
