"""FSDP2 in your own training loop with lowbit: FP8 linears whose all-gather moves the FP8 weight copies (fp8-block),
or BF16 whose all-gather moves the weights' BF16 casts. Both gathers are bit-identical to gathering FP32 weights.

    torchrun --nproc_per_node 2 examples/fsdp2_own_loop.py                     # GPUs (NCCL)
    torchrun --nproc_per_node 2 examples/fsdp2_own_loop.py --recipe bf16
    torchrun --nproc_per_node 2 examples/fsdp2_own_loop.py --device cpu --dim 256 --steps 5   # CPUs (gloo)

The model learns a fixed random teacher (a regression: the loss falls). The order that matters:
1. build the model (lowbit modules: ``lowbit.nn.LayerNormMLP`` here, or ``lowbit.convert`` of your own);
2. ``lowbit.nn.fp8_all_gather`` (FP8 recipes) or ``lowbit.nn.bf16_all_gather`` (BF16), before ``fully_shard``;
3. ``fully_shard`` each block, then the root;
4. the optimizer (``lowbit.optim.AdamW``: on CUDA its step also writes each shard's FP8 copies, which the next
   gather moves);
5. each forward under ``torch.autocast`` (BF16) and, for an FP8 recipe, ``lowbit.autocast(recipe=...)``.
"""

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lowbit


class Block(torch.nn.Module):
    """x + SwiGLU MLP(RMSNorm(x)), one lowbit module."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = lowbit.nn.LayerNormMLP(dim, 2 * dim, activation="swiglu", normalization="RMSNorm", bias=False)

    def forward(self, x):
        return x + self.mlp(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", choices=("fp8-block", "fp8-current", "bf16"), default="fp8-block")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dim", type=int, default=1024, help="model width (fp8-block: a multiple of 128 x the GPUs)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens a rank a step")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))

    torch.manual_seed(0)  # (the same initial weights on every rank; fully_shard keeps each rank's shard)
    model = torch.nn.Sequential(*(Block(args.dim) for _ in range(args.blocks))).to(device)
    teacher = torch.randn(args.dim, args.dim, device=device) / args.dim**0.5
    recipe = lowbit.recipes.from_name(args.recipe)  # (None for bf16)
    if recipe is None:
        plan = lowbit.nn.bf16_all_gather(model)
    else:
        plan = lowbit.nn.fp8_all_gather(model, recipe, mesh)
    if rank == 0:
        kept = {k: v for k, v in plan.items() if v is not None}  # (weight name -> why it gathers in FP32)
        print(f"{args.recipe}: {len(plan) - len(kept)} of {len(plan)} weights gather in low precision", kept or "")
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = lowbit.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def quantized():
        return lowbit.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()

    torch.manual_seed(1 + rank)  # (each rank its own batches)
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.dim, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16), quantized():
            y = model(x)
        loss = (y.float() - x @ teacher).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            loss = loss.detach()
            dist.all_reduce(loss)  # (the sum over the ranks; gloo has no AVG)
            if rank == 0:
                print(f"step {step + 1}: loss {loss.item() / world:.4f}", flush=True)
    # free FSDP2's modules (they hold the process group through reference cycles) while the group is alive: left to
    # the interpreter's exit, a gloo rank can abort after a good run ("terminate called without an active exception")
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
