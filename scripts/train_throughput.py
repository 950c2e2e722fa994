"""Tokens/s of `lowbit train` for recipes x CUDA-graph modes (GPU diagnostic). Usage:
PYTHONPATH=src python scripts/train_throughput.py MODEL STEPS BATCH SEQ recipe[,recipe] mode[,mode]"""
import json
import os
import sys

from lowbit.train.loop import TrainConfig, train

model, steps, bs, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
recipes = sys.argv[5].split(",")
modes = sys.argv[6].split(",")
out = os.environ.get("OUT", "/tmp")
res = []
for r in recipes:
    for m in modes:
        s = train(TrainConfig(recipe=r, model=model, steps=steps, batch_size=bs, seq_len=seq, cuda_graph=m, eval_windows=16,
                              out_dir=f"/tmp/tt/{model}-{r}-{m}", overwrite=True, save_final=False, progress=False, verbose=False))
        row = dict(model=model, recipe=r, cuda_graph=s["cuda_graph"], tokens_per_s=s["tokens_per_s"],
                   final_train_loss=s["final_train_loss"], final_val_loss=s["final_val_loss"], peak_gb=s["peak_memory_bytes"] / 2**30)
        print(json.dumps(row), flush=True)
        res.append(row)
with open(f"{out}/throughput_{model}.json", "w") as f:
    json.dump(res, f, indent=1)
