"""Serve a Hugging Face causal LM with lowbit: each prompt's prefill with FP8 linears and INT8·FP8 attention, the
decode steps in BF16. Eager decode runs one token at a time and is bound by the host, where FP8 linears cost more
than they save (BENCHMARKS.md, "HF client prefill"); the prefill of a long prompt is where they pay.

    python examples/hf_generate.py                                    # random-init Llama 3.2 1B shapes, CUDA
    python examples/hf_generate.py --model meta-llama/Llama-3.2-1B    # a checkpoint (from_pretrained)
    python examples/hf_generate.py --device cpu --tiny --prompt-len 48 --new-tokens 8   # CPU smoke run

The steps:
1. load the model in BF16 and ``lowbit.convert(model, fuse_qkv=True, fuse_mlp=True)`` (one GEMM for each attention's
   Q, K, V and one for each MLP's gate and up);
2. ``lowbit.integrations.transformers.use(model, AttentionConfig(qk="int8", pv="fp8"))``: the model's attention calls
   go to lowbit (decode steps, q_len 1, go to SDPA, counted);
3. around all prompts, ``lowbit.nn.cached_weights(model)``: each weight is quantized for the first prompt and kept
   for the next ones while it is unchanged;
4. per prompt, the prefill ``model(prompt, use_cache=True, logits_to_keep=1)`` under ``torch.inference_mode()`` and
   ``lowbit.autocast(recipe=...)``; then greedy decode steps with the returned KV cache outside ``lowbit.autocast``,
   where lowbit's modules compute as the HF ones do, in BF16.
"""

import argparse
import inspect
import time

import torch

import lowbit
from lowbit.integrations import transformers as lbt

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384, rope_theta=500000.0,
                tie_word_embeddings=False)


def load(args):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(args.device)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**(TINY if args.tiny else LLAMA_1B), attn_implementation="sdpa"))
    return model.to(torch.bfloat16)


def cache_kw(model):
    """The forward's KV-cache argument and its output's field: "cache" where the model's forward takes it (newer
    transformers), else "past_key_values"."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a transformers checkpoint (default: random-init Llama shapes)")
    p.add_argument("--tiny", action="store_true", help="a tiny random-init Llama (CPU smoke runs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipe", default="fp8-block", help="the prefill's recipe (default fp8-block)")
    p.add_argument("--prompts", type=int, default=3, help="prompts served one after another (default 3)")
    p.add_argument("--prompt-len", type=int, default=8192, help="tokens a prompt (default 8192)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens after each prompt (default 32)")
    args = p.parse_args()
    for name in ("prompts", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    recipe = lowbit.recipes.from_name(args.recipe)

    model = load(args).eval()
    summary = lowbit.convert(model, fuse_qkv=True, fuse_mlp=True)
    print(f"converted {len(summary.converted)} linears, fused {len(summary.fused)} groups")
    impl = lbt.use(model, lbt.AttentionConfig(qk="int8", pv="fp8"))
    vocab, ckw = model.config.vocab_size, cache_kw(model)
    gen = torch.Generator().manual_seed(1)

    with lowbit.nn.cached_weights(model) as kept:
        for i in range(args.prompts):
            ids = torch.randint(0, vocab, (1, args.prompt_len), generator=gen).to(args.device)
            sync(args.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                with lowbit.autocast(recipe=recipe):  # the prefill: FP8 linears, INT8·FP8 attention
                    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                sync(args.device)
                t1 = time.perf_counter()
                cache, tokens = getattr(out, ckw), [token]
                for _ in range(args.new_tokens - 1):  # the decode steps, BF16 (outside lowbit.autocast)
                    out = model(input_ids=token, use_cache=True, **{ckw: cache})
                    cache, token = getattr(out, ckw), out.logits[:, -1].argmax(-1, keepdim=True)
                    tokens.append(token)
                sync(args.device)
                t2 = time.perf_counter()
            print(f"prompt {i}: prefill {args.prompt_len} tokens in {(t1 - t0) * 1e3:.1f} ms, "
                  f"{args.new_tokens} tokens in {(t2 - t1) * 1e3:.1f} ms: {torch.cat(tokens, -1)[0, :8].tolist()} ...")
    stats = lbt.stats(impl)
    print(f"attention: {stats.served} calls served by lowbit, {stats.calls - stats.served} passed to SDPA")
    print(f"weights: {kept.reused} quantized copies reused")


if __name__ == "__main__":
    main()
