"""torch.compile of lowbit's quantized layers: the lowbit::quantized_linear / lowbit::quantized_swiglu_mlp operators
(schema, fake implementation and autograd via torch.library.opcheck), full-graph tracing with no graph break, and the
compiled results against eager, bit for bit, for every recipe (delayed scaling over two steps included)."""

import copy

import pytest
import torch
from nn_helpers import lowbit_ops, recording_backend

import lowbit
from lowbit.nn import state as ac
from lowbit.ops.swiglu import swiglu
from lowbit.recipes import QUANTIZED_NAMES, from_name
from lowbit.runtime import env

RECIPES = list(QUANTIZED_NAMES)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles from scratch (the recompile limit counts across the tests' many modules and recipes)."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _run(mod, x, recipe, steps=2, autocast_dtype=None):
    """Forward + backward ``steps`` times (seeded per step); the outputs and every gradient of each step. The loss
    is linear in the output (a seeded random weighting), so its gradient does not depend on the output: a result
    that moves by rounding under one mode does not move the next step's delayed scales."""
    outs = []
    for s in range(steps):
        torch.manual_seed(s)
        with lowbit.autocast(recipe=recipe):
            with torch.autocast(x.device.type, autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                y = mod(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + s)).to(y.device)
        (y.float() * g).sum().backward()
        outs.append([y.detach().clone(), x.grad.clone()]
                    + [p.grad.clone() for p in mod.parameters() if p.grad is not None])
        x.grad = None
        for p in mod.parameters():
            p.grad = None
    return outs


def _check_same(eager, compiled):
    assert len(eager) == len(compiled)
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert len(e) == len(c), f"step {step}: {len(e)} eager tensors, {len(c)} compiled"
        for i, (a, b) in enumerate(zip(e, c)):
            assert a.dtype == b.dtype and a.shape == b.shape, (step, i)
            assert torch.equal(a, b), f"step {step}, tensor {i}: max diff {(a.float() - b.float()).abs().max()}"


class WrittenOut(torch.nn.Module):
    """An RMSNorm ``LayerNormLinear`` or SwiGLU ``LayerNormMLP`` (no biases in the MLP) written out with its own
    Parameters: torch's RMSNorm, then ``lowbit.nn.Linear`` (and ``lowbit.ops.swiglu``, fc2): what the fused module
    computes inside torch.compile where its linears trace (:func:`lowbit.nn.functional.linear_traces`). Parameters
    in the fused module's order."""

    def __init__(self, fused):
        super().__init__()
        self.norm_weight, self.eps, self.mlp = fused.layer_norm_weight, fused.eps, hasattr(fused, "fc1_weight")
        if self.mlp:
            w1, w2 = fused.fc1_weight, fused.fc2_weight
            self.fc1 = lowbit.nn.Linear(w1.shape[1], w1.shape[0], bias=False, device=w1.device)
            self.fc2 = lowbit.nn.Linear(w2.shape[1], w2.shape[0], bias=False, device=w2.device)
            self.fc1.weight, self.fc2.weight = w1, w2
        else:
            w = fused.weight
            self.fc1 = lowbit.nn.Linear(w.shape[1], w.shape[0], bias=fused.bias is not None, device=w.device)
            self.fc1.weight, self.fc1.bias = w, fused.bias

    def forward(self, x):
        h = self.fc1(torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norm_weight, self.eps))
        return self.fc2(swiglu(h)) if self.mlp else h


# the fused modules whose linears trace inside torch.compile under these recipes (their norm then torch's)
def _traces_fused(module: str, recipe: str) -> bool:
    return module in ("rmsnorm_linear", "mlp_swiglu") and recipe == "fp8-block"


MODULES = {
    "linear": lambda: lowbit.nn.Linear(64, 96),
    "layernorm_linear": lambda: lowbit.nn.LayerNormLinear(64, 96),
    "rmsnorm_linear": lambda: lowbit.nn.LayerNormLinear(64, 96, normalization="RMSNorm"),
    "mlp_gelu": lambda: lowbit.nn.LayerNormMLP(64, 160),
    "mlp_swiglu": lambda: lowbit.nn.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", bias=False),
    # (eager without the FP8 gradient hand-off, which a compiled graph does not make: see the GUIDE)
    "multihead_attention": lambda: lowbit.nn.MultiheadAttention(64, 4, normalization="RMSNorm", fp8_grad_handoff=False),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_module_matches_eager(module, recipe):
    """fullgraph=True (a graph break raises) through AOTAutograd: outputs and gradients equal eager's, two steps."""
    torch.manual_seed(0)
    base = MODULES[module]()
    x = torch.randn(3, 32, 64, requires_grad=True)
    rec = from_name(recipe)
    eager = _run(copy.deepcopy(base), x, rec)
    compiled = _run(torch.compile(copy.deepcopy(base), backend="aot_eager", fullgraph=True), x, rec)
    _check_same(eager, compiled)


def test_another_recipe_recompiles():
    """A graph compiled under one recipe is not reused under another: the second recipe's results are its own."""
    torch.manual_seed(0)
    base = lowbit.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    c = torch.compile(copy.deepcopy(base), backend="aot_eager", fullgraph=True)
    for name in ("fp8-current", "nvfp4", "fp8-current"):
        _check_same(_run(copy.deepcopy(base), x, from_name(name), steps=1), _run(c, x, from_name(name), steps=1))


def test_disabled_autocast_compiles_to_torch():
    torch.manual_seed(0)
    m = lowbit.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with lowbit.autocast(enabled=False):
        y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(y, torch.nn.functional.linear(x, m.weight, m.bias))


def test_state_key_names_recipe_and_policy():
    r = from_name("fp8-block")
    with lowbit.autocast(recipe=r):
        k = ac.get_state().key
        assert ac.from_key(k) == (r, "raise")
        with lowbit.autocast(on_nonfinite="skip"):
            assert ac.get_state().key != k
    assert ac.get_state().key == ""
    with pytest.raises(ValueError, match="key"):
        ac.from_key("nope")


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "mxfp8", "nvfp4", "fp8-delayed"])
@pytest.mark.parametrize("gelu", [False, True])
def test_opcheck_quantized_linear(recipe, gelu):
    """torch.library.opcheck: schema, fake implementation (shapes, dtypes, strides) and registered autograd."""
    from lowbit.nn.functional import quantized_linear_op

    torch.manual_seed(1)
    m = lowbit.nn.Linear(64, 96)
    x = torch.randn(32, 64, requires_grad=True)
    # (NVFP4 rounds gradients stochastically from torch's generator: opcheck's two backward runs draw different
    # seeds, so its gradient comparison is left out there; the module tests reseed and compare bit for bit)
    utils = ("test_schema", "test_faketensor") if recipe == "nvfp4" else None
    with lowbit.autocast(recipe=from_name(recipe)):
        key = ac.get_state().key
        torch.library.opcheck(quantized_linear_op, (x, m.weight, m.bias, None, None, key, gelu, 0.0, torch.float32, -1,
                                                    True, True), **({"test_utils": utils} if utils else {}))


def test_opcheck_quantized_linear_backward():
    from lowbit.nn.functional import quantized_linear_backward_op, quantized_linear_op

    torch.manual_seed(2)
    m = lowbit.nn.Linear(64, 96)
    x = torch.randn(32, 64)
    with lowbit.autocast(recipe=from_name("fp8-current")):
        key = ac.get_state().key
        outs = quantized_linear_op(x, m.weight, m.bias, None, None, key, True, 0.0, torch.float32, -1, True, True)
        dy = torch.randn_like(outs[0])
        torch.library.opcheck(quantized_linear_backward_op, (dy, None, m.weight.detach(), m.bias.detach(), None,
                                                             [t.detach() for t in outs[1:]], key, True, 0.0,
                                                             torch.float32, True, True, False, True))


def test_compiled_sentry_still_raises():
    """The NaN sentry sees the compiled operators' amaxes: a NaN input raises at the autocast exit."""
    m = torch.compile(lowbit.nn.Linear(32, 32), backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    with pytest.raises(ac.NonFiniteAmaxError):
        with lowbit.autocast(recipe=from_name("fp8-current")):
            m(x)


def _tiny_converted_llama(layers: int):
    """A random-init HF Llama (vocab 128, hidden 64, GQA 4/2 heads) with its Linears converted, lm_head kept."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    lowbit.convert(model, skip=["lm_head"])
    return model


def test_compiled_converted_hf_model_smoke():
    """A tiny converted HF Llama, compiled (full graph through AOTAutograd): its loss and gradients equal eager's."""
    base = _tiny_converted_llama(layers=2)
    ids = torch.randint(0, 128, (2, 32))

    def step(model):
        torch.manual_seed(0)
        with lowbit.autocast(recipe=from_name("fp8-block")):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = step(copy.deepcopy(base))
    compiled = step(torch.compile(copy.deepcopy(base), backend="aot_eager"))
    _check_same([eager], [compiled])


def check_fused_paths():
    """Under Triton's interpreter the fused kernels run on the CPU: the RMSNorm fused into the input quantizer and
    SwiGLU fused into fc2's (1x128 blockwise, bfloat16 autocast). Compiled (full graph) equals eager, and the fused
    SwiGLU operator is what ran."""
    import importlib

    sw = importlib.import_module("lowbit.ops.swiglu")  # (the module: lowbit.ops.swiglu is also the function)
    calls = []
    orig = sw.swiglu_quantize_1x128

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    sw.swiglu_quantize_1x128 = spy
    rec = from_name("fp8-block")
    for make in (lambda: lowbit.nn.LayerNormMLP(128, 128, normalization="RMSNorm", activation="swiglu", bias=False),
                 lambda: lowbit.nn.LayerNormLinear(128, 256, normalization="RMSNorm", bias=False)):
        torch.compiler.reset()
        torch.manual_seed(0)
        base = make()
        x = torch.randn(2, 64, 128, requires_grad=True)
        eager = _run(copy.deepcopy(base), x, rec, autocast_dtype=torch.bfloat16)
        compiled = _run(torch.compile(copy.deepcopy(base), backend="aot_eager", fullgraph=True), x, rec,
                        autocast_dtype=torch.bfloat16)
        _check_same(eager, compiled)
    assert len(calls) == 4, calls  # the MLP's two steps, eager and compiled
    print("ok")


def test_fused_paths_interpreter_subprocess():
    pytest.importorskip("triton")
    from interp_helper import run_interpreted

    run_interpreted(__file__, "check_fused_paths()", 1200)


# ------------------------------------------------------------------------------------------------
# GPU: inductor
# ------------------------------------------------------------------------------------------------
GPU_MODULES = {
    "linear": lambda: lowbit.nn.Linear(1024, 768, device="cuda"),
    # (every dim a multiple of 512: fp8-block's layers are traced as torch operations, see functional.py)
    "linear_traced": lambda: lowbit.nn.Linear(1024, 1536, device="cuda"),
    # (fprop K / 128 = 9, dgrad's 5: cuBLAS runs both with K zero-padded to a multiple of 512)
    "linear_traced_k_padded": lambda: lowbit.nn.Linear(1152, 640, device="cuda"),
    "rmsnorm_linear": lambda: lowbit.nn.LayerNormLinear(1024, 768, normalization="RMSNorm", device="cuda"),
    "mlp_swiglu": lambda: lowbit.nn.LayerNormMLP(1024, 1536, normalization="RMSNorm", activation="swiglu", bias=False,
                                                 device="cuda"),
    "mlp_gelu": lambda: lowbit.nn.LayerNormMLP(1024, 1536, device="cuda"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "fp8-delayed", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("module", list(GPU_MODULES))
def test_gpu_compiled_matches_eager(module, recipe):
    """On CUDA (the Triton kernels and fused paths) through AOTAutograd, fullgraph, under torch.autocast(bfloat16)
    with FP32 parameters: the outputs and gradients of two steps equal eager's bit for bit."""
    torch.manual_seed(0)
    base = GPU_MODULES[module]()
    x = torch.randn(4, 512, getattr(base, "in_features", 1024), device="cuda", requires_grad=True)
    rec = from_name(recipe)
    # (a fused module whose linears trace: eager runs it written out, as the compiled graph does)
    ref = WrittenOut(copy.deepcopy(base)) if _traces_fused(module, recipe) else copy.deepcopy(base)
    eager = _run(ref, x, rec, autocast_dtype=torch.bfloat16)
    compiled = _run(torch.compile(copy.deepcopy(base), backend="aot_eager", fullgraph=True), x, rec,
                    autocast_dtype=torch.bfloat16)
    _check_same(eager, compiled)


# Inductor compiles the torch ops around lowbit's (a LayerNorm, an unfused SwiGLU) with its own rounding order; where
# lowbit's operators are all there is, its results equal eager's bit for bit.
INDUCTOR_CASES = [("linear", r) for r in ("fp8-current", "fp8-block", "fp8-delayed", "mxfp8", "nvfp4")] + [
    ("linear_traced", "fp8-block"), ("linear_traced", "fp8-current"), ("linear_traced", "fp8-delayed"),
    ("linear_traced_k_padded", "fp8-block"),
    ("mlp_swiglu", "fp8-block"), ("rmsnorm_linear", "fp8-block")]


@pytest.mark.gpu
@pytest.mark.parametrize("module,recipe", INDUCTOR_CASES)
@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_gpu_inductor_matches_eager(module, recipe, mode):
    """Inductor (default, autotuned, CUDA-graphed) on CUDA: three steps equal eager's bit for bit."""
    if mode is not None and recipe != "fp8-block" and module != "linear_traced":
        pytest.skip("the other modes on the blockwise recipe and the traced linear")
    torch.manual_seed(0)
    base = GPU_MODULES[module]()
    x = torch.randn(4, 512, getattr(base, "in_features", 1024), device="cuda", requires_grad=True)
    rec = from_name(recipe)
    if _traces_fused(module, recipe):
        # (its norm is Inductor's there: the same module written out, compiled alike, is what it equals)
        eager = _run(torch.compile(WrittenOut(copy.deepcopy(base)), fullgraph=mode != "reduce-overhead", mode=mode),
                     x, rec, steps=3, autocast_dtype=torch.bfloat16)
    else:
        eager = _run(copy.deepcopy(base), x, rec, steps=3, autocast_dtype=torch.bfloat16)
    compiled = _run(torch.compile(copy.deepcopy(base), fullgraph=mode != "reduce-overhead", mode=mode), x, rec,
                    steps=3, autocast_dtype=torch.bfloat16)
    if mode == "max-autotune-no-cudagraphs" and (module == "linear_traced" and recipe != "fp8-block"
                                                 or _traces_fused(module, recipe)):
        # Inductor's autotuner times its candidates in each compile: a traced tensorwise GEMM may run its own Triton
        # kernel, and the two compiles of a fused module (it and the module written out) may each pick another
        # reduction config for the norm's backward. The same operands summed in another FP32 order: over K <= 4096
        # products that moves a result by at most K * 2**-24 <= 2**-12 of the largest magnitude, plus one rounding
        # of a BF16 output (2**-8, relative)
        for step, (e, c) in enumerate(zip(eager, compiled)):
            for i, (a, b) in enumerate(zip(e, c)):
                torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=2**-12 * a.float().abs().max(),
                                           msg=lambda m, step=step, i=i: f"step {step}, tensor {i}: {m}")
        return
    _check_same(eager, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_gpu_traced_linear_fp32_matches_eager(recipe):
    """FP32 activations without torch.autocast (an FP32 output, the bias added in the epilogue): Inductor's three
    steps equal eager's bit for bit, gradients included."""
    torch.manual_seed(0)
    base = GPU_MODULES["linear_traced"]()
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    rec = from_name(recipe)
    eager = _run(copy.deepcopy(base), x, rec, steps=3)
    compiled = _run(torch.compile(copy.deepcopy(base), fullgraph=True), x, rec, steps=3)
    assert all(t.abs().sum() > 0 for step in compiled for t in step)
    _check_same(eager, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_traced_linear_runs_the_cuda_gemm_as_eager_does(mode, monkeypatch):
    """At M >= lowbit.gemm.cuda_sm90.MIN_M on sm_90 the traced fp8-block linear's forward and data-gradient GEMMs run
    lowbit's CUDA kernel (its operator in the graph), as eager's do: three Inductor steps (CUDA-graphed too) equal
    eager's bit for bit, and the compiled steps launch the kernel."""
    from lowbit.gemm import cuda_sm90

    if not cuda_sm90.status().startswith("1x128"):
        pytest.skip(f"lowbit's CUDA GEMM: {cuda_sm90.status()}")
    launches = []
    launch = cuda_sm90._launch

    def counted(*a):  # (the launches the kernel made, not the calls it declined)
        y = launch(*a)
        if y is not None:
            launches.append(a[0].shape)
        return y

    monkeypatch.setattr(cuda_sm90, "_launch", counted)
    torch.manual_seed(0)
    # (what the kernel takes: BF16 out, no bias; the data gradient comes out in x's dtype)
    base = lowbit.nn.Linear(1024, 1536, bias=False, device="cuda")
    x = torch.randn(8, cuda_sm90.MIN_M // 8, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rec = from_name("fp8-block")
    with env.override(LOWBIT_DEEPGEMM=False):  # (where installed, eager would run DeepGEMM first)
        eager = _run(copy.deepcopy(base), x, rec, steps=3, autocast_dtype=torch.bfloat16)
        assert len(launches) == 6, launches  # (eager: the forward and the data gradient of each step)
        launches.clear()
        compiled = _run(torch.compile(copy.deepcopy(base), fullgraph=mode is None, mode=mode), x, rec, steps=3,
                        autocast_dtype=torch.bfloat16)
    assert len(launches) == 6 if mode is None else len(launches) >= 2, launches  # (CUDA graphs: replays run none)
    _check_same(eager, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["linear_traced", "linear_operator"])
def test_gpu_reduce_overhead_delayed_scaling_matches_eager(module):
    """Delayed scaling under torch.compile's CUDA graphs, the traced linear (its histories' device state read and
    updated by the replayed graphs) and a linear the graph holds as lowbit's operator (K = 1000: its scale chosen and
    its amaxes folded on the device while the graph records), committed on the device at each exit: four steps across
    the end of the warm-up, outputs, gradients, histories, scales and step counts equal eager's bit for bit; a step
    that fails inside autocast leaves the state as eager's does."""
    from lowbit.recipes import DelayedScaling

    torch.manual_seed(0)
    base = GPU_MODULES["linear_traced"]() if module == "linear_traced" else lowbit.nn.Linear(1000, 776, device="cuda")
    x = torch.randn(4, 512, base.in_features, device="cuda", requires_grad=True)
    rec = DelayedScaling(amax_history_len=4, warmup_steps=2)
    eager, comp = copy.deepcopy(base), copy.deepcopy(base)
    m = torch.compile(comp, mode="reduce-overhead")
    outs, states = [], []
    counters = torch._dynamo.utils.counters
    counters.clear()
    for mod, layer in ((eager, eager), (m, comp)):
        outs.append(_run(mod, x, rec, steps=4, autocast_dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="user error"):
            with lowbit.autocast(recipe=rec):
                with torch.autocast("cuda", torch.bfloat16):
                    mod(x * 3)
                raise RuntimeError("user error")
        states.append({k: v.clone() for k, v in layer.get_extra_state().items()})
    _check_same(*outs)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])  # (the graphs did replay)
    assert states[0].keys() == states[1].keys() and int(states[0]["input.steps"]) == 4
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), (k, states[0][k], states[1][k])


@pytest.mark.gpu
def test_gpu_reduce_overhead_refuses_state_across_calls():
    """What lives across calls cannot live in torch.compile's CUDA graphs where lowbit's Python keeps it: a weight
    cached by is_first_microbatch=True gets a clear error, not wrong bits."""
    lin = GPU_MODULES["linear"]()
    m = torch.compile(lambda x: lin(x, is_first_microbatch=True), mode="reduce-overhead")
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    with pytest.raises(Exception, match="is_first_microbatch: True caches the quantized weight"):
        for _ in range(3):
            with lowbit.autocast(recipe=from_name("fp8-block")):
                m(x).sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["linear", "linear_traced"])
def test_gpu_reduce_overhead_sentry_sees_nan(module):
    """Inside torch.compile's CUDA graphs the NaN sentry still fires: a replayed step whose input holds a NaN raises
    NonFiniteAmaxError naming the layer's input, and the next finite step runs clean (the operator and the traced
    linear alike)."""
    lin = GPU_MODULES[module]()
    lowbit.nn.name_modules(torch.nn.Sequential(lin))
    m = torch.compile(lin, mode="reduce-overhead")
    rec = from_name("fp8-block")
    x = torch.randn(512, 1024, device="cuda")

    def step(inp):
        lin.zero_grad(set_to_none=True)  # (a graph's outputs are not accumulated into)
        with lowbit.autocast(recipe=rec):
            y = m(inp)
        y.float().sum().backward()
        ac.check_nonfinite(wait=True)

    for _ in range(4):  # warm-up, recording, replays
        step(x)
    bad = x.clone()
    bad[7, 11] = float("nan")
    with pytest.raises(lowbit.nn.NonFiniteAmaxError, match="input"):
        step(bad)
    step(x)
    step(x)
    # then a plain CUDA-graph capture in the same process (lowbit train's graphs): its autocast exit must not check
    # the board inside the capture (an event recorded there cannot be waited on afterwards)
    eager = GPU_MODULES["linear"]()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            with lowbit.autocast(recipe=rec):
                eager(x).float().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with lowbit.autocast(recipe=rec):
            eager(x).float().sum().backward()
    g.replay()
    ac.check_nonfinite(wait=True)
    lowbit.nn.nonfinite_events()


def test_in_graph_pool_off_the_gpu():
    """Outside CUDA graphs (and on the CPU) nothing allocates from a graph pool: the sentry and caches stay on."""
    from lowbit.runtime.device import in_graph_pool

    assert in_graph_pool(torch.device("cpu")) is False
    if torch.cuda.is_available():
        assert in_graph_pool(torch.device("cuda")) is False


def test_per_block_compile_shares_one_graph():
    """The torchtitan pattern, each decoder block compiled on its own: the blocks share one graph (the layers' state
    is found from their weights at run time, nothing per layer is guarded), so N blocks do not recompile N times."""
    import torch._dynamo

    model = _tiny_converted_llama(layers=4)
    ref = copy.deepcopy(model)
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(block, backend="aot_eager")
    ids = torch.randint(0, 128, (2, 32))

    def step(m):
        with lowbit.autocast(recipe=from_name("fp8-block")):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None]

    # (torch's own config.patch, not monkeypatch: monkeypatch's undo left the option hidden in this torch, so a later
    # compile in the same process failed reading it: "torch._dynamo.config.error_on_recompile does not exist")
    with torch._dynamo.config.patch(error_on_recompile=True):
        _check_same([step(ref)], [step(model)])


def test_anonymous_layer_not_inherited_at_a_reused_address():
    """A weight no lowbit module holds gets a layer of its own (what the compiled operators find from the weight):
    the same layer for every alias of its storage (a detached view), and a fresh one for another tensor that the
    allocator puts at a freed weight's address, which must not inherit the old weight's delayed-scaling history."""
    from lowbit.nn.functional import layer_of

    w = torch.empty(96, 64)
    g = layer_of(w)
    assert layer_of(w.detach()) is g and layer_of(w) is g
    g.delayed = "history of the freed weight"
    for _ in range(50):  # (the CPU allocator hands a freed block of the same size back almost every time)
        ptr = w.data_ptr()
        del w
        w = torch.empty(96, 64)
        if w.data_ptr() == ptr:
            break
        g = layer_of(w)
        g.delayed = "history of the freed weight"
    else:
        pytest.skip("the allocator never reused the address")
    fresh = layer_of(w)
    assert fresh is not g and fresh.delayed is None


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "fp8-delayed"])
def test_gpu_traced_linear_holds_no_opaque_operator(recipe):
    """Under fp8-current, fp8-block and fp8-delayed the compiled graph holds the layer itself (the quantizers,
    the cuBLAS calls, the sentry's record), not the lowbit::quantized_linear operator: every recipe records into the
    layer's slot tensors (graph inputs, no sentry operator); delayed scaling reads its histories' device state (graph
    inputs) and calls no operator of its own."""
    codes = []

    def backend(gm, inputs):
        codes.append(gm.print_readable(print_output=False))
        return gm.forward

    lin = GPU_MODULES["linear_traced"]()
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    with lowbit.autocast(recipe=from_name(recipe)):
        y = torch.compile(lin, backend=backend, fullgraph=True)(x)
    y.float().sum().backward()
    code = "\n".join(codes)
    records = ["sentry_slots_0_", "sentry_slots_1_", "sentry_slots_2_"]
    if recipe == "fp8-delayed":
        records.append("device_state")
    assert "lowbit.quantized_linear" not in code and all(r in code for r in records), code[:2000]
    assert "lowbit.sentry_record" not in code and "lowbit.sentry_pass" not in code, code[:2000]
    assert ("lowbit.quantize_fp8_blockwise" in code) == (recipe == "fp8-block"), code[:2000]


@pytest.mark.gpu
def test_gpu_traced_linear_slots_take_no_launch():
    """Under fp8-block the forward of three traced linears makes six blockwise launches (the inputs' and the weights'
    copies), each max-accumulating its amax into its layer's slot, and no other kernel touches a slot."""
    import re

    from torch._inductor.utils import run_and_get_code

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(1024, device="cuda")
            self.q, self.k, self.v = (lowbit.nn.Linear(1024, 1024, bias=False, device="cuda") for _ in range(3))

        def forward(self, x):
            h = self.norm(x)
            return self.q(h) + self.k(h) + self.v(h)

    torch.compiler.reset()
    mod = QKV()
    m = torch.compile(mod, fullgraph=True)
    x = torch.randn(4, 512, 1024, device="cuda")
    with lowbit.autocast(recipe=from_name("fp8-block")):
        m(x)  # (allocates the slots; the next call compiles with them)
        torch.compiler.reset()
        _, codes = run_and_get_code(m, x)
    code = "\n".join(codes)
    launches = re.findall(r"^\s*(\w+)\.run\(([^\n]*)\)", code, flags=re.M)
    blockwise = [args for name, args in launches if name.startswith("blockwise_kernel")]
    assert len(blockwise) == 6, code[:4000]
    assert "copy_" not in code, code[:4000]
    # the slots are the graph's only (1,) inputs (three a layer; grad_output's is saved for the backward): each
    # forward slot is passed to one blockwise launch and to no other kernel
    slots = re.findall(r"assert_size_stride\((primals_\d+), \(1, \), \(1, \)\)", code)
    assert len(slots) == 9, code[:4000]
    users = [[name for name, args in launches if re.search(rf"\b{slot}\b", args)] for slot in slots]
    assert sorted(len(u) for u in users) == [0] * 3 + [1] * 6, users
    assert all(name.startswith("blockwise_kernel") for u in users for name in u), users


def test_opcheck_sentry_pass():
    from lowbit.nn.functional import sentry_pass_op, sentry_record_op

    m = lowbit.nn.Linear(64, 96)
    with lowbit.autocast(recipe=from_name("fp8-current")):
        key = ac.get_state().key
        scales = [torch.rand(1, 1), torch.rand(4, 2).t()]
        torch.library.opcheck(sentry_pass_op, (scales, [torch.rand(1)], m.weight.detach(), key, "grad_output",
                                               "backward"))
        torch.library.opcheck(sentry_record_op, ([torch.rand(1)], m.weight.detach(), key, "input", "forward"))


@pytest.mark.parametrize("op", ["sentry_record", "sentry_pass"])
def test_sentry_records_survive_reuse_of_their_inputs(op):
    """A compiled graph reuses an operator's input buffers once the call returns: the sentry checks the amaxes as
    they were at the call (an Inf overwritten with 1 afterwards still raises; a 1 overwritten with Inf does not)."""
    from lowbit.nn import functional as fn

    m = lowbit.nn.Linear(64, 96)
    lowbit.nn.name_modules(torch.nn.Sequential(m))

    def call(first, later):
        a = torch.full((1,), first)
        with lowbit.autocast(recipe=from_name("fp8-current")):  # (the forward's records are checked at its exit)
            key = ac.get_state().key
            args = ([a], m.weight.detach(), key, "input", "forward")
            if op == "sentry_pass":
                args = ([torch.ones(1)], *args)
            getattr(fn, f"{op}_op")(*args)
            a.fill_(later)
        ac.check_nonfinite(wait=True)

    with pytest.raises(ac.NonFiniteAmaxError, match="input"):
        call(float("inf"), 1.0)
    call(1.0, float("inf"))


def _fits(recipe, M, N, K, **cfg):
    """The traced linear's rules for x (M, K) BF16 and an FP32 weight (N, K)."""
    from lowbit.nn.functional import _Cfg, traced_linear_rules

    rec = from_name(recipe)
    c = dict(layer=None, recipe=rec, is_first_microbatch=None, gelu=False, policy="raise", out_dtype=torch.bfloat16)
    c.update(cfg)
    return traced_linear_rules(rec, _Cfg(**c), M, N, K, torch.bfloat16, torch.float32)


def test_traced_linear_rules():
    """Which compiled linears are traced as torch operations: fp8-current where cuBLAS takes the dims (multiples of
    16), fp8-delayed alike, fp8-block where the blocks divide them (multiples of 128; a 128x128 grid whose K/128 is not
    divisible by 4 runs K-padded); never with MXFP8 / NVFP4, a GELU, a fused norm or a weight cached across
    micro-batches."""
    assert _fits("fp8-current", 2048, 1536, 1024)
    assert not _fits("fp8-current", 2048, 1000, 1024)
    assert _fits("fp8-block", 2048, 1536, 1024)
    assert _fits("fp8-block", 8192, 5632, 2048) and _fits("fp8-block", 8192, 2048, 5632)
    assert _fits("fp8-block", 2048, 768, 1024)  # dgrad: N / 128 = 6 grid columns, padded to 8
    assert _fits("fp8-block", 8192, 2816, 1024) and _fits("fp8-block", 8192, 1024, 2816)  # K / 128 = 22, padded
    assert not _fits("fp8-block", 2048, 1000, 1024)  # N not whole blocks
    assert not _fits("fp8-block", 2000, 1024, 1024)  # tokens not whole blocks
    assert _fits("fp8-delayed", 2048, 1024, 1024)  # (per-tensor delayed scaling, its state graph inputs)
    for r in ("mxfp8", "nvfp4"):
        assert not _fits(r, 2048, 1024, 1024), r
    assert not _fits("fp8-current", 2048, 1024, 1024, gelu=True)
    assert not _fits("fp8-current", 2048, 1024, 1024, norm_eps=1e-6)
    assert not _fits("fp8-current", 2048, 1024, 1024, is_first_microbatch=True)


def _trace_on_cpu(monkeypatch):
    """Let CPU tensors take the traced linear (its rules as on CUDA; torch's CPU _scaled_mm runs per-tensor GEMMs)."""
    from lowbit.nn import functional as fn

    monkeypatch.setattr(fn, "_traced_linear_fits", lambda x, w, r, c: fn.traced_linear_rules(
        r, c, x.numel() // x.shape[-1], w.shape[0], w.shape[1], x.dtype, w.dtype))


def test_traced_linear_traces_on_cpu(monkeypatch):
    """The traced Function (tensorwise: torch's CPU _scaled_mm runs it) compiles with fullgraph=True and no
    lowbit::quantized_linear operator, gives gradients of the right shapes, records its amaxes in the layer's slots
    inside the graph (no sentry operator), and the sentry still raises on a NaN input. (Its bits against eager are the
    GPU tests': on the CPU eager runs the float64 reference GEMM.)"""
    _trace_on_cpu(monkeypatch)
    codes = []

    def backend(gm, inputs):
        codes.append(gm.print_readable(print_output=False))
        return gm.forward

    lin = lowbit.nn.Linear(64, 96)
    m = torch.compile(lin, backend=backend, fullgraph=True)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with lowbit.autocast(recipe=from_name("fp8-current")):
        y = m(x)
    y.float().square().sum().backward()
    code = "\n".join(codes)
    assert "lowbit.quantized_linear" not in code and "lowbit.sentry" not in code and "copy_" in code
    assert y.shape == (2, 32, 96) and x.grad.shape == x.shape and lin.weight.grad.shape == lin.weight.shape
    assert lin.bias.grad is not None and torch.isfinite(y).all()
    bad = x.detach().clone()
    bad[1, 3, 5] = float("nan")
    with pytest.raises(ac.NonFiniteAmaxError, match="input"):
        with lowbit.autocast(recipe=from_name("fp8-current")):
            m(bad)


def test_traced_linear_sentry_off_holds_no_operator_on_cpu(monkeypatch):
    """on_nonfinite="off": the compiled traced linear records nothing (no slot copies, no sentry operator, forward or
    backward graph), gives the same bits as under "raise" (outputs and gradients), and a NaN input raises nothing and
    reports nothing: it shows in the output."""
    _trace_on_cpu(monkeypatch)
    codes = []

    def backend(gm, inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            codes.append(g.print_readable(print_output=False))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    torch.manual_seed(0)
    lin = lowbit.nn.Linear(64, 96)
    x = torch.randn(2, 32, 64)
    out, copies = {}, {}
    for policy in ("raise", "off"):
        codes.clear()
        torch.compiler.reset()
        m = torch.compile(lin, backend=backend, fullgraph=True)
        xi = x.clone().requires_grad_(True)
        lin.zero_grad(set_to_none=True)
        with lowbit.autocast(recipe=from_name("fp8-current"), on_nonfinite=policy):
            y = m(xi)
        y.float().square().sum().backward()
        code = "\n".join(codes)
        assert len(codes) == 2 and "lowbit.quantized_linear" not in code and "lowbit.sentry" not in code
        copies[policy] = code.count("copy_")
        out[policy] = (y, xi.grad, lin.weight.grad, lin.bias.grad)
        if policy == "raise":  # the forward's slots checked (and zeroed) at the exit; the backward's hold max |dy|
            sx, sw, sdy = (t.view(torch.float32) for t in lin._gemms[""].sentry_slots)
            assert torch.equal(torch.cat([sx, sw]), torch.zeros(2))
            assert torch.equal(sdy, (2 * y.detach()).abs().amax().reshape(1))
    assert copies["raise"] > copies["off"]  # (the slots' copies)
    for a, b in zip(out["raise"], out["off"]):
        assert torch.equal(a, b)
    bad = x.clone()
    bad[1, 3, 5] = float("nan")
    ac.nonfinite_events()
    with lowbit.autocast(recipe=from_name("fp8-current"), on_nonfinite="off"):
        y = m(bad)
    assert not torch.isfinite(y).all() and ac.nonfinite_events() == []


def test_traced_linear_takes_any_leading_dims_on_cpu(monkeypatch):
    """The traced linear reads its input N-D as it comes (no reshape before the quantizers): a 1-D, 2-D and 3-D
    input give the 2-D call's outputs and input gradients, bit for bit, in their own shapes."""
    _trace_on_cpu(monkeypatch)
    torch.manual_seed(0)
    lin = lowbit.nn.Linear(64, 32)
    m = torch.compile(lin, fullgraph=True)
    x = torch.randn(6, 64)
    g = torch.randn(6, 32)

    def run(shape_x, shape_g):
        xi = x.reshape(shape_x).clone().requires_grad_(True)
        with lowbit.autocast(recipe=from_name("fp8-current")):
            y = m(xi)
        y.backward(g.reshape(shape_g))
        return y, xi.grad

    y2, dx2 = run((6, 64), (6, 32))
    y3, dx3 = run((2, 3, 64), (2, 3, 32))
    assert y3.shape == (2, 3, 32) and dx3.shape == (2, 3, 64)
    assert torch.equal(y3.reshape(6, 32), y2) and torch.equal(dx3.reshape(6, 64), dx2)
    x, g = x[:1], g[:1]
    y2, dx2 = run((1, 64), (1, 32))
    y1, dx1 = run((64,), (32,))
    assert y1.shape == (32,) and dx1.shape == (64,)
    assert torch.equal(y1, y2[0]) and torch.equal(dx1, dx2[0])


def test_traced_linear_slots_skip_policy_reports_each_event_once_on_cpu(monkeypatch):
    """Under "skip", an Inf output gradient recorded in the compiled layer's backward slot is reported by
    nonfinite_events() after the backward (named, with its step, once: the next steps report nothing), and so is a
    NaN input at the forward's exit."""
    _trace_on_cpu(monkeypatch)
    lin = lowbit.nn.Linear(64, 64)
    lowbit.nn.name_modules(torch.nn.ModuleDict({"proj": lin}))
    m = torch.compile(lin, fullgraph=True)
    rec = from_name("fp8-current")
    x = torch.randn(128, 64)
    g = torch.randn(128, 64)
    ac.nonfinite_events()

    def step(inp, dy):
        with lowbit.autocast(recipe=rec, on_nonfinite="skip"):
            y = m(inp.requires_grad_())
        y.backward(dy)
        return ac.nonfinite_events()

    assert step(x.clone(), g) == []
    bad_g = g.clone()
    bad_g[3, 4] = float("inf")
    s = ac.step()
    ev = step(x.clone(), bad_g)
    assert [(e.layer, e.role, e.phase, e.step, e.policy) for e in ev] == [("proj", "grad_output", "backward", s + 1,
                                                                           "skip")]
    assert step(x.clone(), g) == [] and step(x.clone(), g) == []
    bad = x.clone()
    bad[0, 0] = float("nan")
    ev = step(bad, g)
    assert ("proj", "input", "forward") in {(e.layer, e.role, e.phase) for e in ev}
    assert step(x.clone(), g) == []


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_traced_linear_slots_without_grad_on_cpu(mode, monkeypatch):
    """A compiled traced linear run without autograd (no_grad, inference_mode) still records its forward's amaxes
    in its slots: a NaN input raises at the autocast exit, a finite one does not."""
    _trace_on_cpu(monkeypatch)
    lin = lowbit.nn.Linear(64, 96)
    m = torch.compile(lin, fullgraph=True)
    x = torch.randn(2, 32, 64)
    with mode(), lowbit.autocast(recipe=from_name("fp8-current")):
        m(x)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ac.NonFiniteAmaxError, match="input"):
        with mode(), lowbit.autocast(recipe=from_name("fp8-current")):
            m(bad)


def test_traced_linear_slots_keep_every_call_since_the_check_on_cpu(monkeypatch):
    """The slots hold the running max of every call since the last check: a layer called twice inside one autocast
    region raises at the exit for a NaN in the first call's input, though the second call's is finite."""
    _trace_on_cpu(monkeypatch)
    lin = lowbit.nn.Linear(64, 64)
    lowbit.nn.name_modules(torch.nn.ModuleDict({"proj": lin}))
    m = torch.compile(lin, fullgraph=True)
    x = torch.randn(16, 64)
    bad = x.clone()
    bad[2, 3] = float("nan")
    with torch.no_grad(), lowbit.autocast(recipe=from_name("fp8-current")):
        m(x), m(x)
    with pytest.raises(ac.NonFiniteAmaxError, match="input"):
        with torch.no_grad(), lowbit.autocast(recipe=from_name("fp8-current")):
            m(bad)
            m(x)
    with torch.no_grad(), lowbit.autocast(recipe=from_name("fp8-current")):
        m(x)


def test_traced_linear_slots_keep_a_nonfinite_gradient_of_an_earlier_backward_on_cpu(monkeypatch):
    """Two forwards, then two backwards before the next check (as gradient accumulation over kept graphs runs): an
    Inf in the first backward's output gradient still raises at the check after the second, clean one."""
    _trace_on_cpu(monkeypatch)
    lin = lowbit.nn.Linear(256, 256)
    lowbit.nn.name_modules(torch.nn.ModuleDict({"proj": lin}))
    m = torch.compile(lin, fullgraph=True)
    x1, x2 = torch.randn(128, 256, requires_grad=True), torch.randn(128, 256, requires_grad=True)
    for bad in (False, True):
        with lowbit.autocast(recipe=from_name("fp8-current")):
            y1, y2 = m(x1), m(x2)
        g = torch.ones_like(y1)
        if bad:
            g[3, 3] = float("inf")
        y1.backward(g)
        y2.sum().backward()
        if not bad:
            ac.check_nonfinite(wait=True)
    with pytest.raises(ac.NonFiniteAmaxError, match="grad_output"):
        ac.check_nonfinite(wait=True)


def test_sentry_slots_follow_the_module(monkeypatch):
    """A layer's slots are allocated at the outermost autocast entry on its weight's device (none while the weight
    is on the meta device), again after the module moves, and a deep copy of the module gets slots of its own."""
    import copy

    lin = lowbit.nn.Linear(64, 64, device="meta")
    with lowbit.autocast(recipe=from_name("fp8-current")):
        pass
    layer = lin._gemms[""]
    assert layer.sentry_slots is None
    lin.to_empty(device="cpu")
    with lowbit.autocast(recipe=from_name("fp8-current")):
        pass
    fwd, _, bwd = layer.sentry_slots
    assert all(t.shape == (1,) and t.device.type == "cpu" and t.dtype == torch.int32 for t in layer.sentry_slots)
    twin = copy.deepcopy(lin)
    with lowbit.autocast(recipe=from_name("fp8-current")):
        pass
    assert twin._gemms[""].sentry_slots is not None
    assert twin._gemms[""].sentry_slots[0].data_ptr() != fwd.data_ptr()


def _sentry_kept(recipe, device, monkeypatch):
    """A compiled (Inductor) traced linear records every pass's amaxes in its layer's slots (no sentry operator) and
    the sentry checks them: a NaN input raises naming the input (at the autocast exit), an Inf output gradient naming
    grad_output (at the check after the backward), finite steps between them run clean, and the eager sentry's
    records are not used."""
    seen = []
    record = ac.sentry

    def counted(amax, **kw):
        seen.append((kw["role"], kw["phase"]))
        return record(amax, **kw)

    monkeypatch.setattr(ac, "sentry", counted)
    lin = lowbit.nn.Linear(512, 512, device=device)
    m = torch.compile(lin, fullgraph=True)
    rec = from_name(recipe)
    x = torch.randn(256, 512, device=device, requires_grad=True)
    g = torch.randn(256, 512, device=device)

    def step(inp, dy):
        with lowbit.autocast(recipe=rec):
            y = m(inp)
        y.backward(dy.to(y.dtype))
        ac.check_nonfinite(wait=True)

    step(x, g)
    layer = lin._gemms[""]
    assert seen == [] and layer.sentry_armed == "raise" and layer.sentry_slots[0].device == x.device
    bad = x.detach().clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ac.NonFiniteAmaxError, match="input"):
        step(bad.requires_grad_(), g)
    step(x, g)
    bad_g = g.clone()
    bad_g[7, 9] = float("inf")
    with pytest.raises(ac.NonFiniteAmaxError, match="grad_output"):
        step(x, bad_g)
    step(x, g)
    assert seen == []


def test_traced_linear_sentry_kept_by_inductor_on_cpu(monkeypatch):
    """Compiled by Inductor, the traced linear's records (copies into its slots, which nothing in the graph reads)
    still happen every call, in both passes (fp8-current: torch's CPU _scaled_mm takes no blockwise scales)."""
    _trace_on_cpu(monkeypatch)
    assert _fits("fp8-current", 256, 512, 512)
    _sentry_kept("fp8-current", "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_gpu_traced_linear_sentry_kept_by_inductor(recipe, monkeypatch):
    """As on the CPU, on CUDA in the default mode, blockwise included."""
    assert _fits(recipe, 256, 512, 512)
    _sentry_kept(recipe, "cuda", monkeypatch)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_linear_compiled_gradients_equal_its_eager_run_on_cpu(monkeypatch, backend, bias, dtype):
    """The traced Function compiled gives the outputs and gradients of the same Function run eagerly, bit for bit,
    for an FP32 or BF16 input (and output), with or without bias (torch 2.11's Dynamo zeroed every gradient of a
    Function whose output came from a no-op dtype cast: FP32 output with bias)."""
    _trace_on_cpu(monkeypatch)
    torch.manual_seed(0)
    base = lowbit.nn.Linear(128, 96, bias=bias)
    x = torch.randn(2, 64, 128, dtype=dtype, requires_grad=True)
    rec = from_name("fp8-current")
    compiled = _run(torch.compile(copy.deepcopy(base), backend=backend, fullgraph=True), x, rec)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the traced Function, run eagerly
    eager = _run(copy.deepcopy(base), x, rec)
    assert all(t.abs().sum() > 0 for step in eager for t in step)
    _check_same(eager, compiled)


def test_cached_weights_compiled_take_the_kept_copies(monkeypatch):
    """Inside lowbit.nn.cached_weights a compiled layer runs as lowbit's operator (not the traced Function), which
    takes the copies the block keeps: the same bits as eager and as outside the block; leaving the block recompiles
    back to the traced Function (Dynamo guards on the block's count)."""
    _trace_on_cpu(monkeypatch)
    torch.manual_seed(3)
    m = lowbit.nn.Linear(128, 96)
    x = torch.randn(2, 32, 128)
    rec = from_name("fp8-current")
    codes = []
    c = torch.compile(m, backend=recording_backend(codes), fullgraph=True)

    def run(mod):
        with lowbit.autocast(recipe=rec), torch.no_grad():
            return mod(x)

    with lowbit.nn.cached_weights(m) as kept:
        eager = run(m)  # keeps the copy
        assert torch.equal(run(c), eager) and torch.equal(run(c), eager)
        assert kept.reused == 2
        assert "quantized_linear" in lowbit_ops(codes)
    n = len(codes)
    out = run(c)
    assert len(codes) == n + 1 and "quantized_linear" not in lowbit_ops(codes[n:])  # traced again outside
    assert kept.reused == 2 and m._gemms[""].wcache is None
    assert out.shape == eager.shape


def test_cached_weights_keep_the_norm_fusions_where_the_linear_would_trace(monkeypatch):
    """A fused module asks linear_traces with its GEMM's layer: where the plain linear would trace, it gives its norm
    (and SwiGLU) fusion to Inductor; inside a cached_weights block the linear runs as the operator instead, so the
    fusions stay."""
    from lowbit.nn import layernorm_linear, layernorm_mlp

    _trace_on_cpu(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for mod in (layernorm_linear, layernorm_mlp):  # (the fused norm quantizer runs on CUDA only)
        monkeypatch.setattr(mod, "norm_fuses", lambda *a: True)
    lin = lowbit.nn.LayerNormLinear(128, 128, normalization="RMSNorm")
    mlp = lowbit.nn.LayerNormMLP(128, 256, normalization="RMSNorm", activation="swiglu")
    x = torch.randn(32, 128)
    with lowbit.autocast(recipe=from_name("fp8-current")):
        assert not lin.fuses_norm(x) and not mlp.fuses_norm(x)
        with lowbit.nn.cached_weights(lin), lowbit.nn.cached_weights(mlp):
            assert lin.fuses_norm(x) and mlp.fuses_norm(x)


def test_traced_linear_dynamic_shapes_on_cpu(monkeypatch):
    """With dynamic=True (as Dynamo turns on by itself at a second batch shape) the traced Function runs for several
    token counts, each call's results equal to those of a graph compiled for its static shape."""
    _trace_on_cpu(monkeypatch)
    lin = lowbit.nn.Linear(64, 96)
    dyn = torch.compile(copy.deepcopy(lin), backend="aot_eager", fullgraph=True, dynamic=True)
    rec = from_name("fp8-current")
    for tokens in (32, 48, 80):
        x = torch.randn(tokens, 64)
        static = torch.compile(copy.deepcopy(lin), backend="aot_eager", fullgraph=True, dynamic=False)
        with lowbit.autocast(recipe=rec):
            a, b = dyn(x), static(x)
        assert torch.equal(a, b), tokens


def _delayed_steps(mod, lin, rec, steps: int, fail_step: int) -> tuple[list, dict]:
    """``steps`` steps of ``mod`` (``lin`` or its compiled self) under ``rec``; step ``fail_step`` raises inside
    autocast after a forward on a 30x input. Returns every finished step's output and gradients, and the layer's
    state (a weighted loss: the output gradient is not all ones)."""
    outs = []
    for step in range(steps):
        x = (torch.randn(48, 64, generator=torch.Generator().manual_seed(step)) * (step + 1)).requires_grad_()
        try:
            with lowbit.autocast(recipe=rec):
                y = mod(x * (30 if step == fail_step else 1))
                if step == fail_step:
                    raise RuntimeError("user error")
        except RuntimeError:
            continue
        (y * torch.linspace(-1, 1, 96)).sum().backward()
        outs += [y.detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
        lin.zero_grad(set_to_none=True)
    return outs, {k: v.clone() for k, v in lin.get_extra_state().items()}


def _check_delayed_runs(results, steps_recorded: int, outputs: bool = True):
    (oa, sa), (ob, sb) = results
    assert int(sa["input.steps"]) == steps_recorded and len(oa) == len(ob) == 4 * steps_recorded
    assert float(sa["grad_output.pending"]) > 0  # (the last backward's, committed at the next exit)
    for i, (a, b) in enumerate(zip(oa, ob) if outputs else ()):
        assert torch.equal(a, b), i
    for k in sa:
        assert torch.equal(sa[k], sb[k]), (k, sa[k], sb[k])


def test_delayed_scaling_while_a_graph_records_on_cpu(monkeypatch):
    """The path a delayed-scaling layer takes while a CUDA graph records it (forced here on the CPU, where Python runs
    every call): the scale chosen on the device from the history's record count, the amaxes folded into the device
    pending max, the state committed on the device. Over five steps across the end of the warm-up, with a failed step
    in between, outputs, gradients and the state equal the eager path's bit for bit."""
    from lowbit.nn import functional as fn
    from lowbit.recipes import DelayedScaling

    torch.manual_seed(0)
    base = lowbit.nn.Linear(64, 96)
    rec = DelayedScaling(amax_history_len=4, warmup_steps=2)
    results = []
    for graph in (False, True):
        if graph:
            monkeypatch.setattr(fn, "in_graph_pool", lambda device: True)
        lin = copy.deepcopy(base)
        results.append(_delayed_steps(lin, lin, rec, 5, fail_step=2))
        assert lin._gemms[""].delayed.compiled == graph
    _check_delayed_runs(results, 4)


def test_traced_linear_delayed_scaling_failed_step_on_cpu(monkeypatch):
    """A step that fails inside autocast drops the amaxes the compiled graph folded into the histories' device
    pending (restored from the entry's snapshot) and keeps the previous backward's, as eager drops its pending
    amaxes: the state after a failed step and clean ones equals eager's bit for bit (the amaxes do not depend on the
    GEMMs: on the CPU eager runs the float64 reference GEMM, the traced linear torch's _scaled_mm)."""
    from lowbit.recipes import DelayedScaling

    _trace_on_cpu(monkeypatch)
    torch.manual_seed(0)
    base = lowbit.nn.Linear(64, 96)
    rec = DelayedScaling(amax_history_len=4, warmup_steps=1)
    results = []
    for compiled in (False, True):
        lin = copy.deepcopy(base)
        mod = torch.compile(lin, backend="aot_eager", fullgraph=True) if compiled else lin
        results.append(_delayed_steps(mod, lin, rec, 3, fail_step=1))
        assert lin._gemms[""].delayed.compiled == compiled
    _check_delayed_runs(results, 2, outputs=False)


def test_traced_linear_delayed_scaling_state_on_cpu(monkeypatch):
    """DelayedScaling in the traced Function (its scales chosen and its amaxes folded into the histories' device state
    inside the graph, committed on the device at each exit): over three steps, warm-up included, every layer's amax
    histories, scales, step counts and pending amaxes equal eager's bit for bit (the layers' output gradients are all
    ones, so every amax is the same in both runs), and the state is the modules' own."""
    from lowbit.recipes import DelayedScaling

    _trace_on_cpu(monkeypatch)
    class Two(torch.nn.ModuleList):  # two layers on one input: each one's gradient is all ones
        def forward(self, x):
            return torch.cat([self[0](x), self[1](x)], dim=-1)

    torch.manual_seed(0)
    base = Two([lowbit.nn.Linear(64, 96), lowbit.nn.Linear(64, 32)])
    eager, comp = copy.deepcopy(base), copy.deepcopy(base)
    codes = []

    def backend(gm, inputs):
        codes.append(gm.print_readable(print_output=False))
        return gm.forward

    m = torch.compile(comp, backend=backend, fullgraph=True)
    rec = DelayedScaling(amax_history_len=4, warmup_steps=1)
    states = []
    for mod, layers in ((eager, eager), (m, comp)):  # (one run after the other: pending amaxes commit at any exit)
        for step in range(3):
            with lowbit.autocast(recipe=rec):
                y = mod(torch.randn(48, 64, generator=torch.Generator().manual_seed(step)) * (step + 1))
            y.sum().backward()
        states.append([{k: v.clone() for k, v in layer.get_extra_state().items()} for layer in layers])
    assert "device_state" in "\n".join(codes) and "lowbit.quantized_linear" not in "\n".join(codes)
    for sa, sb in zip(*states):
        assert sa.keys() == sb.keys() and sa
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("module", ["rmsnorm_linear", "mlp_swiglu"])
def test_fused_module_traces_where_its_linear_does_on_cpu(module, monkeypatch):
    """Inside torch.compile, where the plain linear traces as torch operations, an RMSNorm module whose norm would
    run inside its input quantizer (and the SwiGLU MLP) leaves the norm to torch and traces its linears: its graph
    holds no lowbit::quantized_linear / quantized_swiglu_mlp operator (whose Python runs every call), and its results
    equal the same module written out (torch's RMSNorm, lowbit.nn.Linear, lowbit.ops.swiglu) compiled alike, bit for
    bit. Eager keeps the fused form."""
    from lowbit.nn import functional as fn
    from lowbit.nn import layernorm_linear, layernorm_mlp

    _trace_on_cpu(monkeypatch)
    for mod in (fn, layernorm_linear, layernorm_mlp):  # (the fused norm runs on CUDA only: asked for here)
        monkeypatch.setattr(mod, "norm_fuses", lambda x, w, r: True)
    monkeypatch.setattr(layernorm_mlp, "swiglu_mlp_fusable", lambda *a, **k: True)
    torch.manual_seed(0)
    fused = MODULES[module]()
    rec = from_name("fp8-current")
    x = torch.randn(3, 32, 64, requires_grad=True)
    with lowbit.autocast(recipe=rec):
        assert fused.fuses_norm(x)  # (eager: the fused form)

    codes = []
    got = _run(torch.compile(fused, backend=recording_backend(codes), fullgraph=True), x, rec)
    ops = lowbit_ops(codes)
    assert not ops & {"quantized_linear", "quantized_swiglu_mlp"}, sorted(ops)
    assert "_scaled_mm" in "\n".join(codes)  # (the traced linear's GEMMs)
    fused.zero_grad(set_to_none=True)
    x.grad = None
    want = _run(torch.compile(WrittenOut(fused), backend="aot_eager", fullgraph=True), x, rec)
    _check_same(want, got)


def test_linear_traces_only_inside_compile(monkeypatch):
    """linear_traces: False outside torch.compile, and for a weight the traced rules refuse; True inside for one
    they take."""
    from lowbit.nn import functional as fn

    _trace_on_cpu(monkeypatch)
    rec, mx = from_name("fp8-current"), from_name("mxfp8")
    x, w = torch.randn(32, 64), torch.randn(96, 64)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def inside(x, w):
        seen.append((fn.linear_traces(x, w, rec), fn.linear_traces(x, w, mx),
                     fn.linear_traces(x, w, rec, is_first_microbatch=True)))
        return x + 1

    assert not fn.linear_traces(x, w, rec)
    inside(x, w)
    assert seen == [(True, False, False)]
