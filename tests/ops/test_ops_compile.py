"""torch.compile of lowbit's fused elementwise ops (lowbit.ops): the lowbit::rope_qkv, lowbit::swiglu and
lowbit::residual_add operators and their backwards (schema, fake implementation and autograd via
torch.library.opcheck; outputs that are whole allocations sharing no storage), each op compiled with fullgraph=True
against eager bit for bit, and the GPT compiled against eager bit for bit (loss and every gradient) with the two
fusions a compiled graph cannot make turned off in eager (LOWBIT_UNFUSE=norm_backward,rope_bwd_quant; and norm_quant
where the linears trace, whose norms are torch's inside the graph).

On the CPU the operators run their references; the kernels run under Triton's interpreter in a child process
(``*interpret*`` tests) and on the GPU (``gpu`` tests: aot_eager, Inductor and Inductor's CUDA graphs)."""
import copy
import shutil

import pytest
import torch
from interp_helper import run_interpreted

import lowbit
from lowbit.models.gpt import GPT, config_from_preset, rope_tables
from lowbit.ops.residual import residual_add, residual_add_op
from lowbit.ops.rope import (
    rope_qkv,
    rope_qkv_backward_op,
    rope_qkv_backward_reference,
    rope_qkv_op,
    rope_qkv_reference,
)
from lowbit.ops.swiglu import swiglu, swiglu_backward_op, swiglu_backward_reference, swiglu_op, swiglu_reference
from lowbit.recipes import from_name
from lowbit.runtime import env

# what a compiled graph cannot carry (objects crossing between operators): eager without them is what it matches
NOT_COMPILED = "norm_backward,rope_bwd_quant"


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _randn(*shape, seed, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


# ------------------------------------------------------------------------------------------------
# the cases: (name, the public function on its inputs, the differentiable inputs, the other arguments)
# ------------------------------------------------------------------------------------------------
def _cases(device, dtypes=(torch.float32, torch.bfloat16)):
    cos, sin = (t.to(device) for t in rope_tables(9, 8, 10000.0))  # (longer than T: the ops take the first T rows)
    out = []
    for i, dt in enumerate(dtypes):
        out.append((f"rope_qkv-{dt}", lambda qkv: rope_qkv(qkv, cos, sin), [_randn(2, 5, 3, 3, 8, seed=i, dtype=dt,
                                                                                    device=device)]))
        out.append((f"swiglu-{dt}", swiglu, [_randn(2, 5, 24, seed=10 + i, dtype=dt, device=device, scale=3.0)]))
        x = _randn(2, 5, 24, seed=20 + i, device=device, scale=3.0)
        y = _randn(2, 5, 24, seed=30 + i, dtype=dt, device=device)
        out.append((f"residual_add-{dt}", residual_add, [x, y]))
        out.append((f"residual_add_rstd-{dt}", lambda x, y: residual_add(x, y, rms_eps=1e-5), [x, y]))
    return out


def _run(fn, inputs, seed=0):
    """Outputs and input gradients of ``fn`` (forward, then backward with seeded gradients of the float outputs
    that need them)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]  # (rstd: None off the kernel)
    diff = [o for o in outs if o.requires_grad]
    grads = [_randn(*o.shape, seed=seed + 100 + j, dtype=o.dtype, device=o.device) for j, o in enumerate(diff)]
    torch.autograd.backward(diff, grads)
    return [o.detach().clone() for o in outs] + [t.grad.clone() for t in leaves]


def _same(eager, compiled, what):
    assert len(eager) == len(compiled), what
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (what, i, float((a.float() - b.float()).abs().max()))


def _recording_backend(seen: set):
    """aot_eager that adds the lowbit operators of its forward and backward graphs to ``seen``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, _):
        seen.update(str(n.target).split(".")[1] for n in gm.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith("lowbit."))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def check_ops_compiled(device, backend="aot_eager", mode=None, expect_ops=None):
    """Every case compiled (fullgraph) equals eager bit for bit, outputs and input gradients; with ``expect_ops``
    (aot_eager only) the graphs hold exactly those lowbit operators over all cases."""
    seen = set()
    for name, fn, inputs in _cases(device):
        torch.compiler.reset()
        be = _recording_backend(seen) if expect_ops is not None else backend
        compiled = torch.compile(fn, backend=be, fullgraph=True, **({"mode": mode} if mode else {}))
        eager = _run(fn, inputs)
        for step in range(2 if mode == "reduce-overhead" else 1):  # (CUDA graphs: a recorded run, then a replay)
            _same(eager, _run(compiled, inputs), (name, backend, mode, step))
    if expect_ops is not None:
        assert seen == set(expect_ops), sorted(seen)
    print("ok")


KERNEL_OPS = {"rope_qkv", "rope_qkv_backward", "swiglu", "swiglu_backward", "residual_add"}


def _op_calls(device, dtype):
    """(op, args) for opcheck: each operator on small inputs (forward ops with inputs that require grad)."""
    cos, sin = (t.to(device) for t in rope_tables(7, 8, 10000.0))
    qkv = _randn(2, 5, 3, 3, 8, seed=1, dtype=dtype, device=device).requires_grad_()
    gs = [_randn(2, 5, 3, 8, seed=2 + i, dtype=dtype, device=device) for i in range(3)]
    h = _randn(2, 5, 24, seed=5, dtype=dtype, device=device, scale=3.0).requires_grad_()
    g = _randn(2, 5, 12, seed=6, dtype=dtype, device=device)
    x = _randn(3, 4, 16, seed=7, device=device).requires_grad_()
    y = _randn(3, 4, 16, seed=8, dtype=dtype, device=device).requires_grad_()
    return [(rope_qkv_op, (qkv, cos, sin)), (rope_qkv_backward_op, (*gs, cos, sin)), (swiglu_op, (h,)),
            (swiglu_backward_op, (h.detach(), g)), (residual_add_op, (x, y, None)), (residual_add_op, (x, y, 1e-5))]


def check_opcheck(device, dtypes=(torch.float32, torch.bfloat16)):
    """torch.library.opcheck on every operator: schema, fake implementation (shapes, dtypes, strides) and autograd."""
    for dt in dtypes:
        for op, args in _op_calls(device, dt):
            torch.library.opcheck(op, args)
    print("ok")


def check_whole_outputs(device):
    """Every output a whole allocation of its own (CUDA graphs track allocations): no storage shared with an input
    or another output, no view into a larger buffer."""
    for op, args in _op_calls(device, torch.bfloat16):
        with torch.no_grad():
            outs = op(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        ptrs = [o.untyped_storage().data_ptr() for o in outs]
        assert len(set(ptrs)) == len(ptrs) and not ins & set(ptrs), op
        for o in outs:
            assert o.is_contiguous() and o.storage_offset() == 0, op
            assert o.untyped_storage().nbytes() == o.numel() * o.element_size(), op
    print("ok")


def _gpt_step(model, ids, recipe, autocast_dtype=None):
    torch.manual_seed(0)
    dev = ids.device.type
    with torch.autocast(dev, autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        with lowbit.autocast(recipe=recipe):
            _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def check_gpt(device, recipes=("fp8-block", "fp8-current"), backend="aot_eager", expect_ops=None, steps=1,
              autocast_dtype=None, cfg=None, seq=32, per_block=False, unfuse=NOT_COMPILED, rel=None):
    """The GPT compiled (fullgraph; ``per_block``: each block compiled on its own) against eager with
    LOWBIT_UNFUSE=``unfuse``: loss and every gradient bit for bit (``rel``: each within that relative L2 distance),
    ``steps`` steps; with ``expect_ops`` (aot_eager only) the lowbit operators its graphs must hold (at least)."""
    torch.manual_seed(0)
    base = GPT(cfg or config_from_preset("tiny")).to(device)
    ids = torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    for name in recipes:
        torch.compiler.reset()
        rec = from_name(name)
        seen = set()
        be = _recording_backend(seen) if expect_ops is not None else backend
        compiled = copy.deepcopy(base)
        if per_block:
            for i, blk in enumerate(compiled.blocks):
                compiled.blocks[i] = torch.compile(blk, backend=be, fullgraph=True)
        else:
            compiled = torch.compile(compiled, backend=be, fullgraph=True)
        eager = copy.deepcopy(base)
        with env.override(LOWBIT_UNFUSE=unfuse):
            for s in range(steps):
                e = _gpt_step(eager, ids, rec, autocast_dtype)
                eager.zero_grad(set_to_none=True)
                c = _gpt_step(compiled, ids, rec, autocast_dtype)
                compiled.zero_grad(set_to_none=True)
                if rel is None:
                    _same(e, c, (name, backend, s))
                    continue
                for i, (a, b) in enumerate(zip(e, c)):
                    d = float((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30))
                    assert d <= rel, (name, backend, s, i, d)
        if expect_ops is not None:
            assert set(expect_ops) <= seen, (name, sorted(seen))
    print("ok")


# ------------------------------------------------------------------------------------------------
# CPU: the operators' reference paths
# ------------------------------------------------------------------------------------------------
def test_opcheck_cpu():
    check_opcheck("cpu", dtypes=(torch.float32, torch.bfloat16, torch.float16))


def test_whole_outputs_cpu():
    check_whole_outputs("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ops_compiled_match_eager_cpu(dtype):
    """The operators themselves (CPU: their references) compiled, fullgraph through AOTAutograd, against their eager
    calls bit for bit, forward and backward (the public functions on the CPU do not route to them: torch code)."""
    cos, sin = rope_tables(9, 8, 10000.0)
    cases = [(lambda qkv: rope_qkv_op(qkv, cos, sin), [_randn(2, 5, 3, 3, 8, seed=1, dtype=dtype)]),
             (swiglu_op, [_randn(2, 5, 24, seed=2, dtype=dtype, scale=3.0)]),
             (lambda x, y: residual_add_op(x, y, 1e-5), [_randn(3, 4, 16, seed=3), _randn(3, 4, 16, seed=4,
                                                                                        dtype=dtype)]),
             (lambda x, y: residual_add_op(x, y, None)[0], [_randn(3, 4, 16, seed=3), _randn(3, 4, 16, seed=4,
                                                                                           dtype=dtype)])]
    for i, (fn, inputs) in enumerate(cases):
        torch.compiler.reset()
        _same(_run(fn, inputs), _run(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs), (i, dtype))


def test_public_functions_compile_cpu():
    """The public functions compile with fullgraph on the CPU too (their torch reference paths) and match eager."""
    check_ops_compiled("cpu")


def test_backward_references():
    """rope_qkv_backward_reference: what autograd computes through rope_qkv_reference; swiglu_backward_reference:
    autograd through swiglu_reference to FP32 rounding (the kernel's expression, not autograd's)."""
    cos, sin = rope_tables(9, 8, 10000.0)
    for dt in (torch.float32, torch.bfloat16):
        qkv = _randn(2, 5, 3, 3, 8, seed=1, dtype=dt).requires_grad_()
        outs = rope_qkv_reference(qkv, cos, sin)
        gs = [_randn(*o.shape, seed=2 + i, dtype=dt) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, gs)
        got = rope_qkv_backward_reference(*[g.transpose(1, 2) for g in gs], cos, sin)
        assert torch.equal(got, qkv.grad), dt
    h = _randn(4, 32, seed=3, scale=3.0, dtype=torch.float64).requires_grad_()
    g = _randn(4, 16, seed=4, dtype=torch.float64)
    swiglu_reference(h).backward(g)
    torch.testing.assert_close(swiglu_backward_reference(h.detach().float(), g.float()).double(), h.grad,
                               rtol=1e-6, atol=1e-6)


def test_ops_bad_input():
    cos, sin = rope_tables(9, 8, 10000.0)
    with pytest.raises(ValueError, match="qkv: expected"):
        rope_qkv_op(torch.zeros(2, 5, 2, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="cos: expected"):
        rope_qkv_op(torch.zeros(2, 12, 3, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="gq, gk, gv: expected one shape"):
        rope_qkv_backward_op(torch.zeros(2, 5, 3, 8), torch.zeros(2, 5, 3, 8), torch.zeros(2, 4, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_op(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="g: expected"):
        swiglu_backward_op(torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="x, y: expected"):
        residual_add_op(torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 8), None)
    with pytest.raises(ValueError, match="rms_eps"):
        residual_add_op(torch.zeros(3, 8), torch.zeros(3, 8), -1.0)


def test_gpt_compiled_matches_eager_cpu():
    """Without the interpreter (torch references for the fused ops): fullgraph, loss and gradients bit for bit."""
    check_gpt("cpu")


def test_compile_before_any_eager_call():
    """A recipe's first use inside a compiled graph (its role table built at construction, not while Dynamo
    traces a global cache's insertion): an RMSNorm LayerNormLinear compiled first, under a recipe no test used."""
    rec = lowbit.recipes.Float8BlockScaling(pow2_scales=False, w_block_scaling_dim=1)
    m = lowbit.nn.LayerNormLinear(64, 96, normalization="RMSNorm")
    x = torch.randn(32, 64)
    c = torch.compile(copy.deepcopy(m), backend="aot_eager", fullgraph=True)
    with lowbit.autocast(recipe=rec):
        assert torch.equal(c(x), m(x))


# ------------------------------------------------------------------------------------------------
# CPU: the kernels under Triton's interpreter (child processes)
# ------------------------------------------------------------------------------------------------
def test_opcheck_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, "check_opcheck('cpu'); t.check_whole_outputs('cpu')")


def test_ops_compiled_interpreter_subprocess():
    pytest.importorskip("triton")
    run_interpreted(__file__, f"check_ops_compiled('cpu', expect_ops={sorted(KERNEL_OPS)!r})")


def test_gpt_compiled_interpreter_subprocess():
    """The tiny GPT under fp8-block (RMSNorm inside the quantizer with the residual kernel's statistics) and
    fp8-current, the fused kernels in the compiled graph as operators (under fp8-current no norm reads the residual
    statistics: its adds are torch's there)."""
    pytest.importorskip("triton")
    current = sorted(KERNEL_OPS - {"residual_add"})
    run_interpreted(__file__, f"check_gpt('cpu', ('fp8-block',), expect_ops={sorted(KERNEL_OPS)!r}); "
                              f"t.check_gpt('cpu', ('fp8-current',), expect_ops={current!r})", 1200)


def test_inductor_interpreter_subprocess():
    """Inductor (CPU code) around the kernels: each op, and each GPT block compiled on its own under fp8-block (see
    test_gpu_gpt_blocks_inductor_match_eager), bit for bit against eager."""
    pytest.importorskip("triton")
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("Inductor's CPU code needs a C++ compiler")
    run_interpreted(__file__, "check_ops_compiled('cpu', 'inductor'); "
                              "t.check_gpt('cpu', ('fp8-block',), backend='inductor', per_block=True, steps=2)", 1200)


# ------------------------------------------------------------------------------------------------
# GPU: the kernels on CUDA, through AOTAutograd and Inductor
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_opcheck(cuda):
    check_opcheck(cuda, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check_whole_outputs(cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mode", [("aot_eager", None), ("inductor", None), ("inductor", "reduce-overhead")])
def test_gpu_ops_compiled_match_eager(cuda, backend, mode):
    check_ops_compiled(cuda, backend, mode, expect_ops=KERNEL_OPS if backend == "aot_eager" else None)


GPU_GPT = dict(n_layer=2, n_head=4, d_model=256, ffn_hidden=512, max_seq_len=256)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current", "mxfp8", "fp8-delayed", "nvfp4"])
def test_gpu_gpt_compiled_matches_eager(cuda, recipe):
    """The GPT under torch.autocast(bfloat16), fullgraph through AOTAutograd: two steps, loss and every gradient
    bit for bit against eager without the two cross-operator fusions; the fused ops ran as operators. Under
    fp8-block its linears trace as torch operations at these shapes, so its RMSNorms are torch's there: eager runs
    them unfused too (norm_quant)."""
    from lowbit.models import GPTConfig

    unfuse = NOT_COMPILED + (",norm_quant" if recipe == "fp8-block" else "")
    check_gpt(cuda, (recipe,), expect_ops={"rope_qkv", "rope_qkv_backward"}, steps=2,
              autocast_dtype=torch.bfloat16, cfg=GPTConfig(**GPU_GPT), seq=256, unfuse=unfuse)


@pytest.mark.gpu
def test_gpu_gpt_blocks_inductor_match_eager(cuda):
    """Each block compiled by Inductor on its own under fp8-block: its linears trace as torch operations and its
    RMSNorms are Inductor's, whose reductions round their own way, so two steps match eager (the norms unfused) to
    FP8 rounding: loss and every gradient within 2% relative L2 distance."""
    from lowbit.models import GPTConfig

    check_gpt(cuda, ("fp8-block",), backend="inductor", steps=2, autocast_dtype=torch.bfloat16,
              cfg=GPTConfig(**GPU_GPT), seq=256, per_block=True, unfuse=NOT_COMPILED + ",norm_quant", rel=2e-2)
