"""The eager contract at run time (issue 11): mutations made by a backward, compilers that
return the wrong outputs, autograd.grad inside a function without differentiable outputs,
multi-output views, metadata mutations followed by views, concurrent first calls, and source
lines on forward and backward nodes. Each case runs eagerly and through aot_function,
aot_module and torch.compile(backend="aotforge_eager") where it applies."""
import threading

import pytest
import torch

from aotforge import aot_function, nop
from .test_eager_contract import COMPILERS, _dynamo_compile, _verify, leaf, nonleaf, plain

D = torch.float64


# --- mutations in the backward ---------------------------------------------------------------
class AddOneToSavedInBackward(torch.autograd.Function):
    """Saves ``buf``; its backward adds one to it in place and scales the gradient by it."""

    @staticmethod
    def forward(ctx, x, buf):
        ctx.save_for_backward(buf)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (buf,) = ctx.saved_tensors
        buf.add_(1)
        return grad * buf, None


def _mutates_in_backward(x, buf):
    return AddOneToSavedInBackward.apply(x, buf)


def _mutates_in_forward_and_backward(x, buf):
    buf.mul_(3)
    return AddOneToSavedInBackward.apply(x, buf)


def _run_steps(fn, make_buffer, steps=2):
    """(buffer after each forward, buffer after each backward, x.grad) over ``steps`` steps."""
    torch.manual_seed(0)
    x, buf = leaf(3), make_buffer()
    seen = []
    for _ in range(steps):
        out = fn(x, buf)
        after_forward = buf.detach().clone()
        out.sum().backward()
        seen.append((after_forward, buf.detach().clone(), x.grad.clone()))
    return seen


BACKWARD_MUTATION_CASES = {
    "plain_buffer": (_mutates_in_backward, lambda: torch.zeros(3, dtype=D)),
    "forward_and_backward": (_mutates_in_forward_and_backward, lambda: torch.ones(3, dtype=D)),
    "leaf_that_requires_grad": (_mutates_in_backward, lambda: torch.zeros(3, dtype=D, requires_grad=True)),
    # mutated in the forward and requiring grad: the graph works on a clone of it, which the
    # backward then mutates
    "forward_and_backward_of_a_non_leaf_that_requires_grad": (
        _mutates_in_forward_and_backward, lambda: torch.ones(3, dtype=D, requires_grad=True) * 1),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(BACKWARD_MUTATION_CASES))
def test_backward_mutation_is_applied_when_the_backward_runs(name, how):
    fn, make_buffer = BACKWARD_MUTATION_CASES[name]
    compiled = (COMPILERS[how] or (lambda f, mode: aot_function(f, nop)))(fn, "train")
    # one step for the non-leaf: a second step would backpropagate into the first step's
    # (freed) graph through the buffer's history
    steps = 1 if "non_leaf" in name else 2
    expected = _run_steps(fn, make_buffer, steps)
    actual = _run_steps(compiled, make_buffer, steps)
    for step, (a, e) in enumerate(zip(actual, expected)):
        for what, x, y in zip(("buffer after forward", "buffer after backward", "x.grad"), a, e):
            torch.testing.assert_close(x, y, msg=lambda m: f"step {step}, {what}: {m}")


def test_backward_mutation_of_a_leaf_under_create_graph_raises_like_eager():
    for fn in (_mutates_in_backward, aot_function(_mutates_in_backward, nop)):
        x, buf = leaf(3), torch.zeros(3, dtype=D, requires_grad=True)
        out = fn(x, buf)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            torch.autograd.grad(out.sum(), x, create_graph=True)


class ScalesGradInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


def test_backward_mutating_its_incoming_gradient_matches_eager():
    # eager changes the gradient tensor the backward received (the caller's, for
    # out.backward(g)); the compiled backward writes its new value back the same way
    def run(fn):
        x = leaf(3)
        gradient = torch.ones(3, dtype=x.dtype)
        fn(x).backward(gradient)
        return x.grad, gradient

    torch.manual_seed(0)
    expected = run(lambda x: ScalesGradInPlace.apply(x))
    torch.manual_seed(0)
    actual = run(aot_function(lambda x: ScalesGradInPlace.apply(x), nop))
    torch.testing.assert_close(actual, expected)


# --- compilers returning the wrong outputs ---------------------------------------------------
def _drop_last_output(gm, example_inputs):
    return lambda *args: list(gm(*args))[:-1]


def _first_element_only(gm, example_inputs):
    return lambda *args: [o.reshape(-1)[:1] if isinstance(o, torch.Tensor) else o for o in gm(*args)]


def _as_float32(gm, example_inputs):
    return lambda *args: [o.float() if isinstance(o, torch.Tensor) else o for o in gm(*args)]


@pytest.mark.parametrize("bad_compiler, match", [
    (_drop_last_output, r"returned \d+ outputs, but the graph has \d+"),
    (_first_element_only, r"returned output 0 as \(1,\)"),
    (_as_float32, "torch.float32"),
])
@pytest.mark.parametrize("role", ["fw_compiler", "bw_compiler", "inference_compiler"])
def test_compiler_returning_wrong_outputs_is_a_clear_error(bad_compiler, match, role):
    def fn(x):
        return x.sin() * 2, x.cos()

    compilers = {"fw_compiler": nop, "bw_compiler": nop, "inference_compiler": nop, role: bad_compiler}
    compiled = aot_function(fn, **compilers)
    x = plain(3, 2) if role == "inference_compiler" else leaf(3, 2)
    with pytest.raises(RuntimeError, match=f"{role}.*{match}"):
        outputs = compiled(x)
        (outputs[0].sum() + outputs[1].sum()).backward()


# --- torch.autograd.grad inside a function without differentiable outputs --------------------
def _gradient_of_cube(x):
    y = (x ** 3).sum()
    (g,) = torch.autograd.grad(y, x)
    return g.detach()


def _gradient_of_detached_copy(x):
    with torch.enable_grad():
        z = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad((z ** 3).sum(), z)
    return g


GRAD_INSIDE_CASES = {
    "no_differentiable_output": (_gradient_of_cube, lambda: (leaf(3),), ("train",)),
    "detached_copy_plain_input": (_gradient_of_detached_copy, lambda: (plain(3),), None),
    "detached_copy_leaf_input": (_gradient_of_detached_copy, lambda: (leaf(3),), None),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(GRAD_INSIDE_CASES))
def test_autograd_grad_inside_is_traced_in_grad_mode(name, how):
    fn, make, modes = GRAD_INSIDE_CASES[name]
    kwargs = {"modes": modes} if modes else {}
    if how == "torch_compile":
        if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
            pytest.skip("this Dynamo cannot trace torch.autograd.grad")
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            _verify(fn, make, how, **kwargs)
        return
    _verify(fn, make, how, **kwargs)


# --- multi-output views ----------------------------------------------------------------------
MULTI_OUTPUT_CASES = {
    "unbind_input": (lambda x: x.unbind(0), lambda: nonleaf(3, 2)),
    "unbind_leaf_dim1": (lambda x: x.unbind(1), lambda: (leaf(3, 2),)),
    "split_input": (lambda x: x.split(2), lambda: nonleaf(4, 2)),
    "chunk_input": (lambda x: x.chunk(2), lambda: nonleaf(4, 2)),
    "split_plain_input": (lambda x: x.split(1), lambda: (plain(3),)),
    "unbind_intermediate": (lambda x: (x * 2).unbind(0), lambda: nonleaf(3, 2)),
    "split_sizes_intermediate": (lambda x: (x * 2).split([1, 3]), lambda: nonleaf(4, 2)),
    "chunks_and_their_base": (lambda x: (lambda y: (*y.chunk(2), y))(x.exp()), lambda: nonleaf(4, 2)),
    "one_of_the_views": (lambda x: x.exp().unbind(0)[1], lambda: nonleaf(3, 2)),
    "view_of_unbind_of_input": (lambda x: x.unbind(0)[0].view(-1), lambda: nonleaf(3, 2)),
    "view_of_unbind_of_intermediate": (lambda x: (x * 2).unbind(0)[0].view(2, 1), lambda: nonleaf(3, 2)),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(MULTI_OUTPUT_CASES))
def test_multi_output_views(name, how):
    fn, make = MULTI_OUTPUT_CASES[name]
    _verify(fn, make, how)


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("of_input", [True, False])
def test_in_place_change_of_a_multi_output_view_raises_like_eager(how, of_input):
    fn = (lambda x: x.unbind(0)) if of_input else (lambda x: (x * 2).split(1))
    compiled = (COMPILERS[how] or (lambda f, mode: aot_function(f, nop)))(fn, "train")
    for f in (fn, compiled):
        outputs = f(leaf(2, 3) * 1.0)
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            outputs[0].mul_(2)


# --- metadata mutation followed by views -----------------------------------------------------
def _transpose_then_select(x):
    x.transpose_(0, 1)
    return x[0]


def _transpose_intermediate_then_views(x):
    y = x.sin()
    y.transpose_(0, 1)
    return y.unsqueeze(0), y[:, 0]


def _transpose_view_then_squeeze(x):
    y = x.view(3, 1, 2)
    y.transpose_(0, 1)
    return y.squeeze(0) * 1.0, y.squeeze(0)


def _transpose_size_one_intermediate(x):
    y = x.sin().view(1, 3, 2)
    y.transpose_(0, 1)
    return y.reshape(3, 2), y[0]


METADATA_THEN_VIEW_CASES = {
    "input_transpose_select": (_transpose_then_select, (3, 1)),
    "intermediate_transpose_views": (_transpose_intermediate_then_views, (1, 3)),
    "view_transpose_squeeze": (_transpose_view_then_squeeze, (6,)),
    "size_one_intermediate": (_transpose_size_one_intermediate, (6,)),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("inputs", ["nonleaf", "plain"])
@pytest.mark.parametrize("name", sorted(METADATA_THEN_VIEW_CASES))
def test_metadata_mutation_followed_by_views(name, inputs, how):
    fn, shape = METADATA_THEN_VIEW_CASES[name]
    make = (lambda: nonleaf(*shape)) if inputs == "nonleaf" else (lambda: (plain(*shape),))
    if how == "torch_compile" and name == "input_transpose_select":
        # Dynamo itself refuses in-place view ops on graph inputs.
        with pytest.raises(torch._dynamo.exc.Unsupported):
            _dynamo_compile(fn, "train")(plain(*shape))
        return
    _verify(fn, make, how)


def _restride_size_one_dims(gm, example_inputs):
    """A compiler free to choose the strides of size-1 dimensions (as generated code may)."""
    def run(*args):
        outputs = []
        for o in gm(*args):
            if isinstance(o, torch.Tensor) and o.dim() > 1 and 1 in o.shape:
                stride = [97 if n == 1 else s for n, s in zip(o.shape, o.stride())]
                o = o.as_strided(o.shape, stride, o.storage_offset())
            outputs.append(o)
        return outputs
    return run


def test_base_strides_on_size_one_dims_are_not_a_layout_error():
    compiled = lambda fn, mode: aot_function(fn, _restride_size_one_dims, nop)  # noqa: E731
    for make in (lambda: nonleaf(3, 1), lambda: (plain(3, 1),)):
        _verify(_transpose_intermediate_then_views, make, "aot_function", compile=compiled,
                modes=("train", "inference"), check_output_strides=False)


# --- concurrent first calls ------------------------------------------------------------------
def _call_from_threads(compiled, num_threads=4):
    barrier = threading.Barrier(num_threads)
    errors, grads = [], []

    def work():
        try:
            barrier.wait()
            x = torch.arange(6, dtype=D).view(2, 3).requires_grad_(True)
            compiled(x).sum().backward()
            grads.append(x.grad)
        except Exception as error:  # reported below, with the thread's error
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors, grads


@pytest.mark.parametrize("how", ["aot_function", "torch_compile"])
def test_concurrent_first_calls_compile_once_and_later_compiles_work(how):
    fn = lambda x: (x.sin() * 2).cos().sum(0)  # noqa: E731
    x = torch.arange(6, dtype=D).view(2, 3).requires_grad_(True)
    fn(x).sum().backward()
    for _ in range(3):
        compiled = aot_function(fn, nop) if how == "aot_function" else _dynamo_compile(fn, "train")
        errors, grads = _call_from_threads(compiled)
        assert not errors, errors
        for grad in grads:
            torch.testing.assert_close(grad, x.grad)
        if how == "aot_function":
            assert len(compiled._aotforge_cache) == 1
    later = _dynamo_compile(lambda t: t * 3, "train")
    assert torch.equal(later(torch.ones(2)), torch.full((2,), 3.0))


# --- source lines on forward and backward nodes ----------------------------------------------
def _model_step(x, w):
    y = torch.matmul(x, w)
    z = y.relu()
    return z.sin().sum()


def _recording_compilers():
    graphs = {}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return gm
        return compiler

    return graphs, record


def _last_code_line(stack_trace: str) -> str:
    """The innermost frame's code (Python 3.11+ tracebacks may add a line of ^ markers)."""
    lines = [line.strip() for line in stack_trace.strip().splitlines()]
    return [line for line in lines if line and set(line) - set("^~")][-1]


def _source_of(gm):
    return {
        node.name: _last_code_line(node.meta["stack_trace"])
        for node in gm.graph.nodes
        if node.op == "call_function" and node.meta.get("stack_trace")
    }


def _check_source_lines(graphs):
    forward, backward = graphs["forward"], graphs["backward"]
    for kind, gm in (("forward", forward), ("backward", backward)):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        missing = [n.name for n in nodes if not n.meta.get("stack_trace")]
        assert not missing, f"{kind} nodes without a stack trace: {missing}"
        assert "# File: " in gm.print_readable(print_output=False) and __file__ in gm.print_readable(print_output=False)
    backward_source = _source_of(backward)
    # Each backward op points at the forward line it differentiates.
    assert backward_source["threshold_backward"] == "z = y.relu()"
    assert backward_source["cos"] == "return z.sin().sum()"
    assert any(name.startswith("mm") and line == "y = torch.matmul(x, w)" for name, line in backward_source.items())
    assert _source_of(forward)["relu"] == "z = y.relu()"


def test_aot_function_graphs_keep_source_lines():
    graphs, record = _recording_compilers()
    aot_function(_model_step, record("forward"), record("backward"))(leaf(2, 3), leaf(3, 4)).backward()
    _check_source_lines(graphs)


def test_torch_compile_graphs_keep_source_lines(monkeypatch):
    import aotforge.aot.boxing as boxing

    graphs, record = _recording_compilers()
    kinds = iter(["forward", "backward"])
    original = boxing.boxed_nop

    def recording_nop(gm, example_inputs):
        record(next(kinds))(gm, example_inputs)
        return original(gm, example_inputs)

    monkeypatch.setattr(boxing, "boxed_nop", recording_nop)
    _dynamo_compile(_model_step, "train")(leaf(2, 3), leaf(3, 4)).backward()
    _check_source_lines(graphs)


class CubeWithPythonBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x  # the backward node's own source line


def test_custom_function_backward_nodes_point_at_its_backward():
    graphs, record = _recording_compilers()
    aot_function(lambda x: CubeWithPythonBackward.apply(x).sum(), record("forward"), record("backward"))(leaf(3)).backward()
    lines = set(_source_of(graphs["backward"]).values())
    assert "return grad * 3 * x * x  # the backward node's own source line" in lines
