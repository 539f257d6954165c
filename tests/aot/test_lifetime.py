"""A deleted compiled function frees its graphs and the tensors they hold: nothing of a compile
stays in a thread-local or a global cache (issue 26)."""
import gc
import threading
import weakref

import pytest
import torch

from aotforge import aot_function, aot_module, nop

D = torch.float64


def _compile_and_run(training: bool, backward: bool):
    constant = torch.randn(64, dtype=D)  # closed over: becomes a constant of the graphs

    def f(x):
        return (x * constant).sin()

    compiled = aot_function(f, nop, nop)
    x = torch.randn(64, dtype=D, requires_grad=training)
    out = compiled(x)
    torch.testing.assert_close(out, f(x))
    if backward:
        (grad,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(grad, torch.autograd.grad(f(x).sum(), x)[0])
    graphs = [weakref.ref(part) for part in _graph_modules(compiled)]
    return weakref.ref(constant), weakref.ref(compiled), graphs


def _graph_modules(compiled):
    from aotforge.inspection import inspect

    return [gm for record in inspect(compiled).records for gm in record.graphs.values()]


@pytest.mark.parametrize("training, backward", [(False, False), (True, False), (True, True)])
def test_deleted_aot_function_frees_its_graphs_and_constants(training, backward):
    constant, compiled, graphs = _compile_and_run(training, backward)
    gc.collect()
    assert compiled() is None
    assert graphs and all(graph() is None for graph in graphs), "a graph outlived its compiled function"
    assert constant() is None, "a graph constant outlived its compiled function"


def test_compile_in_another_thread_leaves_nothing_behind():
    results = []
    thread = threading.Thread(target=lambda: results.append(_compile_and_run(True, True)))
    thread.start()
    thread.join()
    gc.collect()
    constant, compiled, graphs = results[0]
    assert compiled() is None and constant() is None and all(g() is None for g in graphs)


def test_deleted_aot_module_frees_the_model_and_its_graphs():
    def make():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).double()
        compiled = aot_module(model, nop, nop)
        x = torch.randn(4, 8, dtype=D)
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
        return weakref.ref(model), weakref.ref(model[0].weight), [weakref.ref(g) for g in _graph_modules(compiled)]

    model, weight, graphs = make()
    gc.collect()
    assert model() is None and weight() is None
    assert graphs and all(g() is None for g in graphs)
