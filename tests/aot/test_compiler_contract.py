"""Misusing the compiler contract is a clear error where the mistake shows, never a silent
None handed to the user or "'NoneType' object is not callable" (issue 26)."""
import pytest
import torch

from aotforge import aot_function, aot_module, nop

D = torch.float64


def _fn(x):
    return x.sin() * 2, x.cos()


def _none_outputs(gm, example_inputs):
    return lambda *args: [None for _ in gm(*args)]


def _returns_none(gm, example_inputs):
    return None


def _returns_graph_code(gm, example_inputs):
    return gm.code  # a string: a common slip


ROLES = ["fw_compiler", "bw_compiler", "inference_compiler"]


def _compiled_and_input(role, compiler):
    compilers = {"fw_compiler": nop, "bw_compiler": nop, "inference_compiler": nop, role: compiler}
    x = torch.randn(3, 2, dtype=D, requires_grad=role != "inference_compiler")
    return aot_function(_fn, **compilers), x


def _run(compiled, x):
    outputs = compiled(x)
    if x.requires_grad:
        (outputs[0].sum() + outputs[1].sum()).backward()
    return outputs


@pytest.mark.parametrize("role", ROLES)
def test_compiled_callable_returning_none_for_a_tensor_is_a_clear_error(role):
    compiled, x = _compiled_and_input(role, _none_outputs)
    with pytest.raises(RuntimeError, match=f"{role} returned None as output 0, where the graph returns a"):
        _run(compiled, x)


@pytest.mark.parametrize("compiler, what", [(_returns_none, "NoneType"), (_returns_graph_code, "str")])
@pytest.mark.parametrize("role", ROLES)
def test_compiler_returning_a_non_callable_is_a_clear_error_when_it_compiles(role, compiler, what):
    compiled, x = _compiled_and_input(role, compiler)
    if role == "bw_compiler":
        outputs = compiled(x)  # the forward is fine and equals eager; the backward compiles lazily
        torch.testing.assert_close(outputs, _fn(x))
    with pytest.raises(TypeError, match=f"{role} returned {what} .*not a callable"):
        _run(compiled, x)


def test_backward_compiled_now_reports_a_non_callable_at_the_first_call():
    from aotforge import aot_module_simplified

    model = torch.nn.Linear(2, 2).double()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 2, dtype=D)
    with pytest.raises(TypeError, match="bw_compiler returned NoneType"):
        aot_module_simplified(gm, [x], nop, _returns_none, compile_backward_now=True)


@pytest.mark.parametrize("fn", [3, None, torch.randn(2)], ids=["int", "None", "tensor"])
def test_non_callable_function_is_rejected_by_aot_function(fn):
    with pytest.raises(TypeError, match="aot_function needs a callable to compile"):
        aot_function(fn, nop)


def test_good_compilers_still_match_eager():
    compiled, x = _compiled_and_input("fw_compiler", nop)
    outputs = compiled(x)
    expected = _fn(x)
    torch.testing.assert_close(outputs, expected)
    torch.testing.assert_close(
        torch.autograd.grad(sum(o.sum() for o in outputs), x),
        torch.autograd.grad(sum(o.sum() for o in expected), x),
    )
    model = torch.nn.Linear(2, 2).double()
    torch.testing.assert_close(aot_module(model, nop, nop)(x.detach()), model(x.detach()))


def _attention_graph():
    """A graph returning cuDNN attention's output (0) and philox seed (6), as traced on a GPU."""
    import operator

    graph = torch.fx.Graph()
    query = graph.placeholder("query")
    attention = graph.call_function(torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                                    (query, query, query, None, False, 0.0, False))
    outputs = [graph.call_function(operator.getitem, (attention, index)) for index in (0, 6)]
    graph.output(outputs)
    outputs[0].meta["val"] = torch.empty(2, 3)
    outputs[1].meta["val"] = torch.empty((), dtype=torch.int64)
    return torch.fx.GraphModule({}, graph)


def _boxed(outputs):
    def run(args):
        return list(outputs)

    run._boxed_call = True
    return run


def test_none_is_accepted_only_where_attention_ops_give_it():
    from aotforge.aot.runtime import check_outputs_once

    gm = _attention_graph()
    result = torch.randn(2, 3)
    # without dropout, cuDNN attention's seed is None: let it through
    assert check_outputs_once(_boxed([result, None]), gm, "fw_compiler")([None])[0] is result
    with pytest.raises(RuntimeError, match="fw_compiler returned None as output 0"):
        check_outputs_once(_boxed([None, None]), gm, "fw_compiler")([None])
