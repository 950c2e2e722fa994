"""lowbit.convert: what is swapped and what is kept, sharing of parameters, unchanged numbers."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit import recipes


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.proj(a)
        return x + self.mlp(x)


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=64, d=32, n=8):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.h = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def test_convert_gpt_defaults_and_numbers():
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 64, (2, 16))
    before = model(idx)
    params = {n: p for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    s = lowbit.convert(model)
    assert torch.equal(torch.get_rng_state(), rng)  # no re-initialisation
    assert {n: p for n, p in model.named_parameters()}.keys() >= {"h.0.qkv.weight", "lm_head.weight"}
    for n, p in model.named_parameters():
        if n in params:
            assert p is params[n]  # shared, not copied
    kept = dict(s.kept)
    assert "output head" in kept["lm_head"] and "embedding" in kept["wte"] and "norm" in kept["ln_f"]
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.h[0].qkv, lowbit.nn.Linear) and model.h[0].qkv.lowbit_name == "h.0.qkv"
    # LayerNorm -> Linear inside the Sequential fused into a LayerNormLinear
    assert isinstance(model.h[3].mlp[1], lowbit.nn.LayerNormLinear) and isinstance(model.h[3].mlp[0], torch.nn.Identity)
    assert isinstance(model.h[3].mlp[3], lowbit.nn.Linear)
    assert s.blocks == ("h", 8) and s.high_precision_blocks == []
    assert len(s.converted) == 8 * 4
    assert torch.equal(model(idx), before)  # outside autocast: the same numbers
    with lowbit.autocast(recipe=recipes.Float8CurrentScaling()):
        out = model(idx)
    out.float().square().mean().backward()
    assert model.h[0].qkv.weight.grad is not None and model.wte.weight.grad is not None
    assert "converted 32 layer(s)" in str(s)


def test_nvfp4_keeps_last_blocks_and_skip_patterns():
    torch.manual_seed(0)
    model = TinyGPT(n=8)
    s = lowbit.convert(model, recipe=recipes.NVFP4BlockScaling(), skip=("*.proj",))
    assert s.high_precision_blocks == [6, 7]  # ceil(15% of 8) = 2 last blocks
    assert type(model.h[7].qkv) is torch.nn.Linear and type(model.h[6].mlp[3]) is torch.nn.Linear
    assert isinstance(model.h[5].qkv, lowbit.nn.Linear)
    assert all(type(b.proj) is torch.nn.Linear for b in model.h)
    assert "skip pattern '*.proj'" in dict(s.kept)["h.0.proj"]

    model = TinyGPT(n=4)
    s = lowbit.convert(model, keep_high_precision_blocks=(0, -1), skip="h.1")
    assert s.high_precision_blocks == [0, 3]
    assert type(model.h[1].qkv) is torch.nn.Linear and isinstance(model.h[2].qkv, lowbit.nn.Linear)


def test_dims_the_recipe_cannot_take_are_kept():
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 64), torch.nn.Linear(64, 8))
    s = lowbit.convert(m, recipe=recipes.MXFP8BlockScaling())
    kept = dict(s.kept)
    assert "not multiples of 32" in kept["0"] and "not multiples of 32" in kept["2"]
    assert "output head" in kept["3"]  # no lm_head: the last Linear is the head


def test_convert_errors():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        lowbit.convert("model")
    with pytest.raises(TypeError, match="recipe: expected a lowbit.recipes recipe"):
        lowbit.convert(torch.nn.Linear(2, 2), recipe="nvfp4")
    with pytest.raises(ValueError, match="keep_high_precision_blocks: block index 9 out of range for 4 blocks"):
        lowbit.convert(TinyGPT(n=4), keep_high_precision_blocks=[9])
    with pytest.raises(ValueError, match="keep_high_precision_blocks: an int keeps the last N blocks"):
        lowbit.convert(TinyGPT(n=4), keep_high_precision_blocks=5)
    with pytest.raises(TypeError, match="skip: expected name patterns"):
        lowbit.convert(TinyGPT(n=2), skip=(1,))
    with pytest.raises(TypeError, match="skip: expected a name pattern .str. or several, got 5"):
        lowbit.convert(TinyGPT(n=2), skip=5)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # no repeated-block container
    # an invalid value is reported as such, before the model is looked at (not as "no repeated-block container")
    for bad, msg in (("last", r"expected 'auto', None, an int >= 0 .*got 'last'"), (True, "got True"),
                     (2.5, "got 2.5"), ([1.5], r"block indices must be ints, got 1.5 in \[1.5\]"),
                     (-1, "N >= 0, got -1")):
        for model in (plain, TinyGPT(n=4)):
            with pytest.raises(ValueError, match="keep_high_precision_blocks: .*" + msg):
                lowbit.convert(model, keep_high_precision_blocks=bad)
    assert type(plain[0]) is torch.nn.Linear  # nothing was converted by the failed calls
    with pytest.raises(ValueError, match="keep_high_precision_blocks: model has no repeated-block container .*got 1"):
        lowbit.convert(plain, keep_high_precision_blocks=1)  # valid, but nothing to pick from
    assert lowbit.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), keep_high_precision_blocks=[]).blocks is None
    for arg in ("keep_output_head", "fuse_norms"):
        with pytest.raises(TypeError, match=f"{arg}: expected a bool, got 'no'"):
            lowbit.convert(plain, **{arg: "no"})


def test_converted_model_checkpoint_loads_weights_only(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(n=2)
    lowbit.convert(model)
    with lowbit.autocast(recipe=recipes.DelayedScaling(amax_history_len=16)):
        model(torch.randint(0, 64, (2, 16))).sum().backward()
    torch.save(model.state_dict(), tmp_path / "ck.pt")
    sd = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert sd["h.0.qkv._extra_state"]["input.history"].shape == (16,)
    other = TinyGPT(n=2)
    lowbit.convert(other)
    other.load_state_dict(sd)
    assert torch.equal(other.h[0].qkv.get_extra_state()["input.history"], sd["h.0.qkv._extra_state"]["input.history"])
