import os
import sys

import torch

# Shared helpers (nn_helpers.py) are imported by name; pytest runs with --import-mode=importlib.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The CI box has 2 cores and runs `pytest -n 2`: one intra-op thread per worker avoids oversubscription.
torch.set_num_threads(1)
