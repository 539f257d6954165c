"""CUDA graphs' decisions, tested on the CPU (compiler/runtime/cudagraphs.py).

``SimulatedCapture`` gives CUDA graph semantics without a GPU: a recording allocates the
outputs once, and a replay reads the static inputs and overwrites those same output tensors.
So everything the record decides (input kinds, static buffers, re-recording, when outputs are
still held, the output policies) is checked here against eager, in real training loops with an
optimizer; tests/gpu/test_gpu_cudagraphs.py runs the same loops with real CUDA graphs."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx

import aotforge
from aotforge import aot_module
from aotforge.testing import LOOP_PATTERNS, assert_same_loops, training_loop
from aotforge.compiler.runtime import cudagraphs
from aotforge.compiler.runtime.cudagraphs import (CLONE, COPY, HOLD, POOL, STATIC, CudaGraphs,
                                                   capture_blocker, mutated_inputs)


class SimulatedCapture:
    """A capture runs the graph only to allocate the outputs (a real capture runs nothing, so
    the inputs' values are restored afterwards and fresh outputs are poisoned); a replay runs
    it on the static inputs and copies the results into the recorded outputs, as a CUDA graph
    writes into its pool."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def unsupported(self, value):
        return None

    def capture(self, run, static_args):
        self.captures += 1
        # storage-level copies: a CUDA graph's writes bump no tensor's version either
        saved = [(a.untyped_storage(), a.untyped_storage().clone()) for a in static_args
                 if isinstance(a, torch.Tensor)]
        outputs = list(run(list(static_args)))
        for storage, value in saved:
            storage.copy_(value)
        inputs = {storage.data_ptr() for storage, _ in saved}
        for output in outputs:
            if isinstance(output, torch.Tensor) and output.untyped_storage().data_ptr() not in inputs:
                output.untyped_storage().fill_(0xCD)
        return (run, outputs), outputs

    needs_args = True  # in-place inputs are read from the call's arguments

    def replay(self, handle, args):
        run, outputs = handle
        self.replays += 1
        for output, new in zip(outputs, run(list(args))):
            if isinstance(output, torch.Tensor) and output.data_ptr() != new.data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(output):
                    output.detach().copy_(new)


def boxed(fn):
    def run(args):
        values = list(args)
        args.clear()
        return list(fn(*values))
    return run


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(cudagraphs, "_warned", set())
    yield
    cudagraphs._pool_outputs.clear()


# --- decisions from the graph -----------------------------------------------------------------

def _fake_cuda(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


def _graph(build) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = _fake_cuda(4)
    out = build(graph, x)
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_capturable_graph_has_no_blocker():
    def build(graph, x):
        node = graph.call_function(torch.ops.aten.relu.default, (x,))
        node.meta["val"] = _fake_cuda(4)
        return node
    assert capture_blocker(_graph(build)) is None


@pytest.mark.parametrize("target, expected", [
    (torch.ops.aten._local_scalar_dense.default, r"\.item\(\)"),
    (torch.ops.aten.nonzero.default, "data-dependent output shape"),
])
def test_synchronizing_and_data_dependent_ops_block_capture(target, expected):
    def build(graph, x):
        node = graph.call_function(target, (x,))
        node.meta["val"] = None
        return node
    reason = capture_blocker(_graph(build))
    assert reason is not None
    import re
    assert re.search(expected, reason)


def test_unbacked_size_blocks_capture():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def build(graph, x):
        node = graph.call_function(torch.ops.aten.relu.default, (x,))
        node.meta["val"] = ShapeEnv().create_unbacked_symint()
        return node
    assert "data-dependent" in capture_blocker(_graph(build))


def test_cpu_tensor_blocks_capture():
    graph = fx.symbolic_trace(lambda x: x + 1)
    for node in graph.graph.nodes:
        node.meta["val"] = torch.zeros(2)
    assert "CPU tensor" in capture_blocker(graph)


def test_host_rng_state_blocks_capture():
    def build(graph, x):
        node = graph.call_function(torch.ops.higher_order.run_and_save_rng_state, (torch.ops.aten.rand.default, [4]))
        node.meta["val"] = None
        return node
    assert "random generator's state" in capture_blocker(_graph(build))


def test_host_scalars_are_allowed_but_host_to_device_copies_block():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        scalar = torch.empty((), dtype=torch.float64)

    def build_read(graph, x):
        s = graph.placeholder("s")
        s.meta["val"] = scalar
        item = graph.call_function(torch.ops.aten._local_scalar_dense.default, (s,))
        item.meta["val"] = 0.5
        node = graph.call_function(torch.ops.aten.mul.Tensor, (x, item))
        node.meta["val"] = _fake_cuda(4)
        return node
    assert capture_blocker(_graph(build_read)) is None

    def build_copy(graph, x):
        s = graph.placeholder("s")
        s.meta["val"] = scalar
        node = graph.call_function(torch.ops.aten._to_copy.default, (s,), {"device": torch.device("cuda")})
        node.meta["val"] = _fake_cuda(())
        return node
    assert "copies a CPU tensor to the GPU" in capture_blocker(_graph(build_copy))


def test_host_scalar_inputs_key_the_recordings_by_value():
    class BakingCapture(SimulatedCapture):
        """Like a CUDA graph, a replay uses the host scalars' values seen at capture."""

        def host_scalar(self, value):
            return value.dim() == 0

        def capture(self, run, static_args):
            self.baked = {i: a.clone() for i, a in enumerate(static_args)
                          if isinstance(a, torch.Tensor) and a.dim() == 0}
            handle, outputs = super().capture(run, static_args)
            return (handle, dict(self.baked)), outputs

        def replay(self, handle, args):
            handle, baked = handle
            super().replay(handle, [baked.get(i, a) for i, a in enumerate(args)])

    capture = BakingCapture()
    wrapper = CudaGraphs(boxed(lambda x, s: (x * s,)), "forward", capture=capture)
    for step in range(8):
        x, s = torch.randn(3), torch.tensor(float(step % 2 + 2), dtype=torch.float64)
        torch.testing.assert_close(wrapper([x, s])[0], x * s)
    assert wrapper.kinds == [COPY, "host scalar"] and len(wrapper.recordings) == 2


def test_mutated_inputs_direct_and_through_views():
    def f(a, b, c):
        a.add_(1)
        b.view(-1)[0:2].mul_(2)
        return c * 2
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.zeros(3), torch.zeros(2, 2), torch.zeros(3))
    assert mutated_inputs(gm) == [0, 1]


# --- the wrapper with simulated capture -------------------------------------------------------

def _wrapper(fn, **kwargs):
    capture = SimulatedCapture()
    return CudaGraphs(boxed(fn), "forward", capture=capture, **kwargs), capture


def test_warm_up_then_record_then_replay_equals_eager():
    weight = torch.nn.Parameter(torch.randn(3))
    f = lambda w, x: (w * x + 1,)  # noqa: E731
    wrapper, capture = _wrapper(f)
    for step in range(4):
        x = torch.randn(3)
        (out,) = wrapper([weight, x])
        torch.testing.assert_close(out, weight * x + 1)
        del out
    assert capture.captures == 1 and capture.replays == 3
    assert wrapper.kinds == [STATIC, COPY]
    assert wrapper.counts["plain: warm-up"] == 1
    text = str(wrapper)
    assert "1 recording(s)" in text and "1 copy, 1 static" in text and "replays 3" in text


def test_output_held_by_a_variable_across_the_next_call():
    # ``loss = model(x)``: the previous loss is still bound while the next call runs; that
    # output is recorded once more, then cloned at each replay
    f = lambda x: (x * 2, x + 1)  # noqa: E731
    wrapper, capture = _wrapper(f)
    for step in range(6):
        first, second = wrapper([torch.full((2,), float(step))])
        assert first.tolist() == [2.0 * step] * 2 and second.tolist() == [step + 1.0] * 2
    assert capture.captures == 2 and capture.replays == 4
    assert list(wrapper.recordings.values())[0].policy == [CLONE, CLONE]


def test_held_outputs_are_never_overwritten():
    f = lambda x: (x * 2,)  # noqa: E731
    wrapper, capture = _wrapper(f)
    kept, expected = [], []
    for step in range(8):
        x = torch.full((3,), float(step))
        kept.append(wrapper([x])[0])
        expected.append(x * 2)
    for got, want in zip(kept, expected):
        torch.testing.assert_close(got, want)
    assert capture.replays >= 5, str(wrapper)  # after one re-recording outputs are cloned
    assert list(wrapper.recordings.values())[0].policy == [CLONE]
    assert "outputs in use" in str(wrapper)


def test_outputs_dropped_each_step_are_handed_out_without_copies():
    f = lambda x: (x * 2,)  # noqa: E731
    wrapper, capture = _wrapper(f)
    for step in range(6):
        out = wrapper([torch.full((3,), float(step))])[0]
        assert out.tolist() == [2.0 * step] * 3
        del out
    assert capture.captures == 1 and capture.replays == 5
    assert list(wrapper.recordings.values())[0].policy == ["hand out"]


@pytest.mark.parametrize("layout", ["misaligned", "expanded", "overlapping", "transposed"])
def test_unusual_input_layouts(layout):
    f = lambda x: (x * 3 + x.sum(),)  # noqa: E731
    wrapper, _ = _wrapper(f)

    def make(step):
        base = torch.randn(20) + step
        if layout == "misaligned":
            return base[1:13].view(3, 4)
        if layout == "expanded":
            return base[:4].expand(3, 4)
        if layout == "overlapping":
            return base.as_strided((3, 4), (2, 1))
        return base[:12].view(4, 3).t()

    for step in range(4):
        x = make(step)
        out = wrapper([x])[0]
        torch.testing.assert_close(out, f(x)[0])
        assert out.stride() == f(x)[0].stride()
        del out
    assert wrapper.counts["replays"] == 3


def test_moved_static_input_is_recorded_again():
    weight = torch.nn.Parameter(torch.ones(3))
    f = lambda w, x: (w * x,)  # noqa: E731
    wrapper, capture = _wrapper(f)
    x = torch.arange(3.0)
    for _ in range(3):
        wrapper([weight, x])
    replaced = torch.nn.Parameter(torch.full((3,), 5.0))
    outs = [wrapper([replaced, x])[0] for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, replaced * x)
    assert capture.captures == 2
    assert "static input moved" in str(wrapper)


def test_input_mutations_are_copied_back():
    def f(x, y):
        x.add_(1)
        return (y * 2,)
    wrapper, _ = _wrapper(f, mutated=[0])
    x = torch.zeros(3)
    for step in range(5):
        wrapper([x, torch.ones(3)])
        assert x.tolist() == [float(step + 1)] * 3


def test_one_recording_per_shape_and_the_limit(monkeypatch):
    monkeypatch.setattr(cudagraphs, "MAX_SHAPES", 2)
    f = lambda x, n: (x * n,)  # noqa: E731
    wrapper, capture = _wrapper(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for size in (2, 3, 2, 3, 4, 4, 5):
            x = torch.randn(size)
            torch.testing.assert_close(wrapper([x, size])[0], x * size)
    assert capture.captures == 2
    assert len(wrapper.recordings) == 2
    limit = [w for w in caught if "more than 2 input shapes" in str(w.message)]
    assert len(limit) == 1
    assert wrapper.counts["plain: over the shape limit"] == 3


def test_capture_failure_falls_back_with_one_warning():
    class Failing(SimulatedCapture):
        def capture(self, run, static_args):
            raise RuntimeError("operation not permitted when stream is capturing")

    wrapper = CudaGraphs(boxed(lambda x: (x + 1,)), "forward", capture=Failing())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            torch.testing.assert_close(wrapper([torch.ones(2) * step])[0], torch.ones(2) * step + 1)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "capturing it failed" in messages[0] and "not permitted" in messages[0]
    assert "off (capturing it failed" in str(wrapper)


def test_blocker_warns_once_and_runs_plainly():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrappers = [CudaGraphs(boxed(lambda x: (x + 1,)), "forward", blocker="node item reads a value",
                               capture=SimulatedCapture()) for _ in range(2)]
    assert len(caught) == 1 and "node item reads a value" in str(caught[0].message)
    assert wrappers[0]([torch.ones(1)])[0].item() == 2


# --- training loops through the AOT layer -----------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.second = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.second(torch.tanh(self.norm(self.first(x)))).pow(2).mean()


def _compiled(model, wrappers):
    def compiler(kind):
        def compile_graph(gm, example_inputs):
            wrapper = CudaGraphs(boxed(gm), kind, mutated=mutated_inputs(gm), capture=SimulatedCapture())
            wrappers.append(wrapper)
            return wrapper
        return compile_graph
    return aot_module(model, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                      inference_compiler=compiler("inference"), keep_inference_input_mutations=True)


@pytest.mark.parametrize("pattern", LOOP_PATTERNS)
def test_training_loops_equal_eager(pattern):
    torch.manual_seed(0)
    batches = [torch.randn(5, 6, dtype=torch.float64) for _ in range(10)]
    eager_model = Net().double()
    model = Net().double()
    model.load_state_dict(eager_model.state_dict())
    wrappers: list = []
    compiled = _compiled(model, wrappers)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    expected = training_loop(pattern, eager_model, eager_model, batches, sgd(eager_model))
    got = training_loop(pattern, model, compiled, batches, sgd(model))
    assert_same_loops(got, expected, rtol=1.3e-6, atol=1e-5)
    replays = sum(w.counts["replays"] for w in wrappers)
    assert replays >= 5, "\n".join(map(str, wrappers))
    if pattern == "accumulate":
        backward = next(w for w in wrappers if w.kind == "backward")
        assert any(HOLD in r.policy for r in backward.recordings.values()), "\n".join(map(str, wrappers))
    if pattern in ("plain", "accumulate"):
        backward = next(w for w in wrappers if w.kind == "backward")
        assert POOL in backward.kinds, str(backward)   # saved activations read in place


def test_retain_graph_two_forwards_then_one_backward():
    torch.manual_seed(0)
    eager_model, model = Net().double(), Net().double()
    model.load_state_dict(eager_model.state_dict())
    wrappers: list = []
    compiled = _compiled(model, wrappers)
    for run, target in ((eager_model, eager_model), (compiled, model)):
        torch.manual_seed(1)
        for _ in range(4):
            losses = [run(torch.randn(5, 6, dtype=torch.float64)) for _ in range(3)]
            sum(losses).backward()
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_record_prints_through_compiled_graph(monkeypatch):
    # what aotforge.inspect / observe() show: the record beside the compiled graph
    from aotforge.compiler.runtime.compiled import CompiledGraph

    wrapper, _ = _wrapper(lambda x: (x + 1,))
    wrapper([torch.ones(2)])
    graph = CompiledGraph("forward", wrapper, None, None, None, (), None, {}, {}, cudagraphs=wrapper)
    assert "## CUDA graphs\nCUDA graphs of the forward graph" in str(graph)


def test_config_off_leaves_the_callable_alone():
    gm = fx.symbolic_trace(lambda x: x + 1)
    run = boxed(gm)
    assert cudagraphs.wrap(run, gm, "forward") is run
    with aotforge.config.patch(cudagraphs=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for node in gm.graph.nodes:
            node.meta["val"] = torch.zeros(1)
        assert cudagraphs.wrap(run, gm, "forward") is run
        assert cudagraphs.wrap(run, gm, "forward") is run
    assert [str(w.message) for w in caught] == [
        "aotforge: CUDA graphs (mode='reduce-overhead', aotforge.config.cudagraphs) have nothing to do for "
        "graphs on the CPU; they run as compiled"]


def test_recordings_go_with_their_graph():
    import gc

    wrapper, _ = _wrapper(lambda x: (x * 2,))
    for _ in range(3):
        wrapper([torch.ones(4)])
    assert len(cudagraphs._pool_outputs) == 1
    del wrapper
    gc.collect()
    assert len(cudagraphs._pool_outputs) == 0


def test_a_re_recorded_producer_drops_the_consumers_reading_its_pool():
    producer, _ = _wrapper(lambda w, x: (w * x,))
    consumer = CudaGraphs(boxed(lambda y: (y + 1,)), "backward", capture=SimulatedCapture())
    weight = torch.nn.Parameter(torch.ones(3))
    for step in range(4):
        (y,) = producer([weight, torch.full((3,), float(step))])
        torch.testing.assert_close(consumer([y])[0], y + 1)
        del y
    assert consumer.kinds == [POOL] and len(consumer.recordings) == 1
    producer([torch.nn.Parameter(torch.ones(3)), torch.ones(3)])  # a moved parameter: re-recorded
    assert len(consumer.recordings) == 0 and "moved" in str(producer)
