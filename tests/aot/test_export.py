"""Export: aot_export_module / aot_export_joint_simple against eager (float64).

Every round trip calls the exported graph with the module's flattened parameters, buffers
and inputs and compares, with eager: user outputs, buffer (and input) updates, and parameter
and input gradients of the loss. Each export restriction is checked for its error message.
"""
import copy
import importlib
import sys

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from aotforge import aot_export_joint_simple, aot_export_module, load_exported, save_exported
from aotforge.aot.export import ExportError, GraphSignature
from aotforge.partition import default_partition

D = torch.float64


def output_names(gm) -> list[str]:
    (output,) = gm.graph.find_nodes(op="output")
    return [n.name if isinstance(n, torch.fx.Node) else repr(n) for n in output.args[0]]


def graph_inputs(mod: nn.Module, args: tuple, kwargs: dict) -> list:
    """What the exported graph takes: (*parameters, *buffers, *flat user inputs)."""
    return [*mod.parameters(), *mod.buffers(), *pytree.tree_leaves((args, kwargs))]


def run_exported(gm, signature: GraphSignature, mod: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Run the graph on the module's state; name each output value."""
    flat = graph_inputs(mod, args, kwargs)
    state = flat[: len(flat) - len(pytree.tree_leaves((args, kwargs)))]
    assert pytree.tree_structure(((*state, *args), kwargs)) == signature.in_spec
    with torch.no_grad():
        values = gm(*flat)
    names = output_names(gm)
    assert len(values) == len(names)
    return dict(zip(names, values))


def fresh_copy(value):
    """A new leaf with the same value and requires_grad (tensors); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def loss_at(index, trace_joint: bool) -> dict:
    """The export arguments for a joint with the loss at ``index``, or an inference export."""
    return {"trace_joint": trace_joint, "output_loss_index": index if trace_joint else None}


def assert_matches_eager(gm, signature, mod, args, kwargs=None, loss_index=None, rtol=1e-7, atol=1e-9):
    """The exported graph reproduces eager's outputs, buffer/input updates and gradients."""
    kwargs = kwargs or {}
    eager_mod = copy.deepcopy(mod)
    eager_args, eager_kwargs = pytree.tree_map(fresh_copy, (args, kwargs))
    graph_args, graph_kwargs = pytree.tree_map(fresh_copy, (args, kwargs))
    expected = eager_mod(*eager_args, **eager_kwargs)
    if loss_index is not None:
        pytree.tree_leaves(expected)[loss_index].backward()
    values = run_exported(gm, signature, mod, graph_args, graph_kwargs)

    outputs = pytree.tree_unflatten([values[n] for n in signature.user_outputs], signature.out_spec)
    for got, want in zip(pytree.tree_leaves(outputs), pytree.tree_leaves(expected)):
        torch.testing.assert_close(got, want.detach(), rtol=rtol, atol=atol)
    assert pytree.tree_structure(outputs) == pytree.tree_structure(expected)

    eager_buffers = dict(eager_mod.named_buffers())
    original_buffers = dict(mod.named_buffers())
    mutated = set(signature.buffers_to_mutate.values())
    for name, fqn in signature.buffers_to_mutate.items():
        torch.testing.assert_close(values[name], eager_buffers[fqn], rtol=rtol, atol=atol)
    for fqn, buffer in original_buffers.items():
        if fqn not in mutated:  # what the graph does not update, eager left alone
            torch.testing.assert_close(buffer, eager_buffers[fqn])

    flat_eager_inputs = pytree.tree_leaves((eager_args, eager_kwargs))
    user_input_index = {name: i for i, name in enumerate(signature.user_inputs)}
    for name, input_name in signature.user_inputs_to_mutate.items():
        want = flat_eager_inputs[user_input_index[input_name]].detach()
        torch.testing.assert_close(values[name], want)

    if loss_index is not None:
        backward = signature.backward_signature
        assert backward is not None and backward.loss_output == signature.user_outputs[loss_index]
        eager_params = dict(eager_mod.named_parameters())
        assert sorted(backward.gradients_to_parameters.values()) == sorted(
            n for n, p in eager_params.items() if p.requires_grad
        )
        for name, fqn in backward.gradients_to_parameters.items():
            torch.testing.assert_close(values[name], eager_params[fqn].grad, rtol=rtol, atol=atol)
        for name, input_name in backward.gradients_to_user_inputs.items():
            want = flat_eager_inputs[user_input_index[input_name]].grad
            torch.testing.assert_close(values[name], want, rtol=rtol, atol=atol)
    else:
        assert signature.backward_signature is None
    return values


# ---------------------------------------------------------------------------------------------
# Models


class LinearBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        y = torch.relu(self.bn(self.linear(x)))
        return (y.pow(2).mean(), y.detach())


class ConvBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, x, target):
        features = self.bn(self.conv(x)).mean(dim=(2, 3))
        logits = self.head(features)
        return nn.functional.cross_entropy(logits, target), logits.detach()


class BufferUpdates(nn.Module):
    """Buffers updated in place (an EMA) and by reassignment (a step counter)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5))
        self.register_buffer("ema", torch.zeros(5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(5))  # read, never written

    def forward(self, x):
        self.ema.mul_(0.9).add_(0.1 * x.mean(0).detach())
        self.steps = self.steps + 1
        y = x * self.weight * self.scale
        return (y - self.ema).square().sum()


class DictModel(nn.Module):
    """kwargs in, a dict out, a user input that requires grad."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x, *, mask, pair):
        hidden = torch.tanh(self.proj(x)) * mask + pair[0] * pair[1]
        return {"logits": hidden.detach(), "loss": hidden.sum()}


def f64(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=D, requires_grad=requires_grad)


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("trace_joint", [True, False], ids=["joint", "inference"])
def test_batchnorm_round_trip(trace_joint):
    torch.manual_seed(0)
    mod = LinearBatchNorm().to(D)
    x = f64(8, 6)
    gm, sig = aot_export_module(mod, (x,), **loss_at(0, trace_joint))
    assert sig.parameters == ["linear.weight", "linear.bias", "bn.weight", "bn.bias"]
    assert sig.buffers == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert sorted(sig.buffers_to_mutate.values()) == sorted(sig.buffers)
    assert sig.user_inputs == [n.name for n in gm.graph.find_nodes(op="placeholder")][-1:]
    names = output_names(gm)
    # (*updated buffers, *user outputs, *parameter gradients)
    assert names[:3] == list(sig.buffers_to_mutate)
    assert names[3:5] == sig.user_outputs
    if trace_joint:
        assert names[5:] == list(sig.backward_signature.gradients_to_parameters)
    assert_matches_eager(gm, sig, mod, (x,), loss_index=0 if trace_joint else None)
    # Export leaves the module as it was.
    assert mod.bn.num_batches_tracked.item() == 0 and mod.linear.weight.grad is None


def test_training_loop_on_the_exported_joint_graph():
    """What a training compiler would do with the joint graph: three SGD steps driven only by
    the graph and its signature track eager training (parameters and running statistics)."""
    torch.manual_seed(0)
    eager = ConvBatchNorm().to(D)
    exported = copy.deepcopy(eager)
    batches = [(f64(4, 2, 5, 5), torch.randint(0, 2, (4,))) for _ in range(3)]
    gm, sig = aot_export_module(exported, batches[0], trace_joint=True, output_loss_index=0)
    parameters, buffers = dict(exported.named_parameters()), dict(exported.named_buffers())
    for x, target in batches:
        loss, _ = eager(x, target)
        eager.zero_grad()
        loss.backward()
        with torch.no_grad():
            for parameter in eager.parameters():
                parameter -= 0.1 * parameter.grad

        state = [*(parameters[n] for n in sig.parameters), *(buffers[n] for n in sig.buffers)]
        inputs = [*state, x, target]
        with torch.no_grad():
            values = dict(zip(output_names(gm), gm(*inputs)))
            for name, fqn in sig.buffers_to_mutate.items():
                buffers[fqn].copy_(values[name])
            for name, fqn in sig.backward_signature.gradients_to_parameters.items():
                parameters[fqn] -= 0.1 * values[name]
        torch.testing.assert_close(values[sig.backward_signature.loss_output], loss.detach())
    for (name, want), got in zip(eager.state_dict().items(), exported.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


def test_frozen_parameters_are_inputs_without_gradients():
    torch.manual_seed(0)
    mod = LinearBatchNorm().to(D)
    mod.linear.weight.requires_grad_(False)
    x = f64(8, 6)
    gm, sig = aot_export_module(mod, (x,), trace_joint=True, output_loss_index=0)
    assert "linear.weight" in sig.inputs_to_parameters.values()
    assert "linear.weight" not in sig.backward_signature.gradients_to_parameters.values()
    assert len(output_names(gm)) == 3 + 2 + 3
    assert_matches_eager(gm, sig, mod, (x,), loss_index=0)


def test_eval_mode_batchnorm_mutates_nothing():
    torch.manual_seed(0)
    mod = LinearBatchNorm().to(D).eval()
    mod.bn.running_mean.normal_()
    x = f64(8, 6)
    gm, sig = aot_export_module(mod, (x,), trace_joint=False)
    assert sig.buffers_to_mutate == {} and len(output_names(gm)) == 2
    assert_matches_eager(gm, sig, mod, (x,))


def test_batchnorm_signature_matches_torch():
    """Same graph and signature as torch's own aot_export_module, up to node names."""
    from torch._functorch.aot_autograd import aot_export_module as torch_export

    torch.manual_seed(0)
    mod = LinearBatchNorm().to(D)
    x = f64(8, 6)
    ours, our_sig = aot_export_module(mod, (x,), trace_joint=True, output_loss_index=0)
    theirs, their_sig = torch_export(mod, (x,), trace_joint=True, output_loss_index=0)

    def position(gm, name, op):
        nodes = gm.graph.find_nodes(op="placeholder") if op == "input" else output_names(gm)
        return [getattr(n, "name", n) for n in nodes].index(name)

    for field in ("parameters", "buffers"):
        assert getattr(our_sig, field) == getattr(their_sig, field)
    def by_position(gm, names_to_fqns: dict, op: str) -> dict:
        return {position(gm, k, op): v for k, v in names_to_fqns.items()}

    for field, op in (
        ("inputs_to_parameters", "input"), ("inputs_to_buffers", "input"), ("buffers_to_mutate", "output")
    ):
        assert by_position(ours, getattr(our_sig, field), op) == by_position(
            theirs, getattr(their_sig, field), op
        ), field
    assert by_position(ours, our_sig.backward_signature.gradients_to_parameters, "output") == by_position(
        theirs, their_sig.backward_signature.gradients_to_parameters, "output"
    )
    assert [position(ours, n, "output") for n in our_sig.user_outputs] == [
        position(theirs, n, "output") for n in their_sig.user_outputs
    ]
    assert our_sig.out_spec == their_sig.out_spec and our_sig.in_spec == their_sig.in_spec

    # Detaches are no-ops in a functional graph: torch's graph keeps a dead one that ours
    # eliminates, and from torch 2.14 its functionalization records each detach as an alias.
    no_ops = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)

    def ops(gm):
        return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target not in no_ops)

    assert ops(ours) == ops(theirs)


def test_conv_batchnorm_joint_with_integer_target():
    torch.manual_seed(0)
    mod = ConvBatchNorm().to(D)
    args = (f64(4, 2, 5, 5), torch.tensor([0, 1, 1, 0]))
    gm, sig = aot_export_module(mod, args, trace_joint=True, output_loss_index=0)
    assert len(sig.buffers_to_mutate) == 3
    assert_matches_eager(gm, sig, mod, args, loss_index=0)


@pytest.mark.parametrize("trace_joint", [True, False], ids=["joint", "inference"])
def test_buffer_updates_in_place_and_by_assignment(trace_joint):
    torch.manual_seed(0)
    mod = BufferUpdates().to(D)
    mod.steps.fill_(3)
    gm, sig = aot_export_module(mod, (f64(4, 5),), **loss_at(0, trace_joint))
    assert sorted(sig.buffers_to_mutate.values()) == ["ema", "steps"]
    assert_matches_eager(gm, sig, mod, (f64(4, 5),), loss_index=0 if trace_joint else None)
    assert mod.steps.item() == 3 and not mod.ema.any()


def test_kwargs_dict_outputs_and_input_gradients():
    torch.manual_seed(0)
    mod = DictModel().to(D)
    args = (f64(2, 3, requires_grad=True),)
    kwargs = {"mask": f64(2, 3), "pair": (f64(3), f64(3, requires_grad=True))}
    # The loss is the dict's second leaf in flattening order (keys are kept in insertion order).
    gm, sig = aot_export_module(mod, args, trace_joint=True, output_loss_index=1, kwargs=kwargs)
    backward = sig.backward_signature
    assert list(backward.gradients_to_user_inputs.values()) == [sig.user_inputs[0], sig.user_inputs[3]]
    assert sig._user_input_paths() == ["args[0]", "kwargs['mask']", "kwargs['pair'][0]", "kwargs['pair'][1]"]
    assert_matches_eager(gm, sig, mod, args, kwargs, loss_index=1)


def test_user_input_mutation_is_an_extra_output():
    class AddInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(3, dtype=D))

        def forward(self, x, y):
            x.add_(self.bias.detach())
            return (x * y + self.bias).sum()

    torch.manual_seed(0)
    mod = AddInPlace()
    args = (f64(2, 3), f64(2, 3))
    for trace_joint in (False, True):
        gm, sig = aot_export_module(mod, args, **loss_at(0, trace_joint))
        assert list(sig.user_inputs_to_mutate.values()) == [sig.user_inputs[0]]
        assert_matches_eager(gm, sig, mod, args, loss_index=0 if trace_joint else None)


def test_parameter_updated_under_no_grad_in_inference_export():
    class Renormalize(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, dtype=D))

        def forward(self, x):
            with torch.no_grad():
                self.weight.div_(self.weight.norm())
            return x @ self.weight

    mod = Renormalize()
    gm, sig = aot_export_module(mod, (f64(3, 4),), trace_joint=False)
    assert list(sig.parameters_to_mutate.values()) == ["weight"]
    values = run_exported(gm, sig, mod, (f64(3, 4),), {})
    (name,) = sig.parameters_to_mutate
    torch.testing.assert_close(values[name], mod.weight.detach() / mod.weight.detach().norm())


def test_tied_weights_get_one_gradient():
    class TiedEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3, dtype=D)
            self.unembed = nn.Linear(3, 5, bias=False, dtype=D)
            self.unembed.weight = self.embed.weight

        def forward(self, tokens):
            hidden = self.embed(tokens)
            return self.unembed(hidden).logsumexp(-1).mean(), hidden.detach()

    mod = TiedEmbedding()
    tokens = torch.tensor([1, 2, 3, 1])
    gm, sig = aot_export_module(mod, (tokens,), trace_joint=True, output_loss_index=0)
    assert sig.parameters == ["embed.weight"]
    assert list(sig.backward_signature.gradients_to_parameters.values()) == ["embed.weight"]
    assert_matches_eager(gm, sig, mod, (tokens,), loss_index=0)


def test_outputs_aliasing_inputs_are_graph_outputs():
    """Unlike the runtime graphs, an exported graph returns views of inputs itself."""

    class Views(_Scaled):
        def forward(self, x):
            return x.view(-1)[:4], self.weight, x * self.weight

    mod, x = Views(), f64(2, 3)
    gm, sig = aot_export_module(mod, (x,), trace_joint=False)
    values = run_exported(gm, sig, mod, (x,), {})
    first, weight, _ = (values[n] for n in sig.user_outputs)
    assert first.data_ptr() == x.data_ptr() and weight is mod.weight
    assert_matches_eager(gm, sig, mod, (x,))


def test_non_tensor_inputs_are_specialized_and_checked():
    class Scale(nn.Module):
        def forward(self, x, factor, offset):
            return x * factor + offset

    x = f64(3)
    gm, sig = aot_export_module(Scale(), (x,), trace_joint=False, kwargs={"factor": 2, "offset": 0.5})
    assert len(sig.user_inputs) == 3
    torch.testing.assert_close(gm(x, 2, 0.5)[0], x * 2 + 0.5)
    with pytest.raises(AssertionError, match=r"exported with user input kwargs\['factor'\] == 2"):
        gm(x, 3, 0.5)


def test_decompositions_are_applied():
    from torch._decomp import get_decompositions

    mod = LinearBatchNorm().to(D)
    x = f64(8, 6)
    decompositions = get_decompositions(
        [torch.ops.aten._native_batch_norm_legit_functional, torch.ops.aten.addmm]
    )
    gm, sig = aot_export_module(mod, (x,), **loss_at(0, True), decompositions=decompositions)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default not in targets
    assert torch.ops.aten._native_batch_norm_legit_functional.default not in targets
    assert_matches_eager(gm, sig, mod, (x,), loss_index=0)


def test_save_and_reload(tmp_path):
    """The graph is Python: written out as a module folder, or pickled with its signature,
    and reloaded, it still reproduces eager."""
    torch.manual_seed(0)
    mod = LinearBatchNorm().to(D)
    x = f64(8, 6)
    gm, sig = aot_export_module(mod, (x,), trace_joint=True, output_loss_index=0)
    assert "def forward(self, arg0_1" in gm.code
    reference = run_exported(gm, sig, mod, (x,), {})

    # save_exported keeps the node names the signature refers to.
    path = tmp_path / "exported.pt"
    save_exported(path, gm, sig)
    torch.save(mod.state_dict(), tmp_path / "state.pt")
    loaded, loaded_sig = load_exported(path)
    assert loaded_sig == sig and loaded.code == gm.code
    fresh = LinearBatchNorm().to(D)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt"))
    reloaded = assert_matches_eager(loaded, loaded_sig, fresh, (x,), loss_index=0)
    for name, value in reference.items():
        torch.testing.assert_close(reloaded[name], value)

    # A plain pickle of the GraphModule runs too (its outputs are used by position).
    torch.save(gm, tmp_path / "plain.pt")
    with torch.no_grad():
        values = torch.load(tmp_path / "plain.pt", weights_only=False)(*graph_inputs(mod, (x,), {}))
    for name, value in zip(output_names(gm), values):
        torch.testing.assert_close(value, reference[name])

    gm.to_folder(tmp_path / "exported_module", "ExportedGraph")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("exported_module").ExportedGraph()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("exported_module", None)
    with torch.no_grad():
        values = module(*graph_inputs(mod, (x,), {}))
    for name, value in zip(output_names(gm), values):
        torch.testing.assert_close(value, reference[name])


def test_export_is_logged_under_graphs(capsys, monkeypatch):
    monkeypatch.setenv("AOTFORGE_LOG", "graphs")
    aot_export_module(LinearBatchNorm().to(D), (f64(8, 6),), trace_joint=True, output_loss_index=0)
    err = capsys.readouterr().err
    assert "aotforge graphs: LinearBatchNorm_export_joint =====" in err
    assert "LinearBatchNorm_export_joint_signature" in err and "buffer    bn.running_mean" in err


def test_signature_describe_names_every_input_and_output():
    mod = LinearBatchNorm().to(D)
    gm, sig = aot_export_module(mod, (f64(8, 6),), trace_joint=True, output_loss_index=0)
    text = sig.describe()
    for name in [n.name for n in gm.graph.find_nodes(op="placeholder")] + output_names(gm):
        assert f"  {name} " in text
    assert "buffer    bn.running_var" in text and "new value of buffer bn.num_batches_tracked" in text
    assert "(the loss)" in text and "gradient of parameter linear.weight" in text


# ---------------------------------------------------------------------------------------------
# aot_export_joint_simple


def _simple(a, b, c):
    return (torch.sin(a) * b, (a @ c).relu(), b.exp().detach())


def test_joint_simple_inference_has_the_functions_convention():
    from torch._functorch.aot_autograd import aot_export_joint_simple as torch_export_simple

    args = (f64(3, 3), f64(3, 3), f64(3, 2))
    gm = aot_export_joint_simple(_simple, args, trace_joint=False)
    theirs = torch_export_simple(_simple, args, trace_joint=False)
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["arg0_1", "arg1_1", "arg2_1"]
    assert gm.code == theirs.code
    for got, want in zip(gm(*args), _simple(*args)):
        torch.testing.assert_close(got, want)


def test_joint_simple_joint_partitions_to_the_functions_convention():
    torch.manual_seed(0)
    args = (f64(3, 3, requires_grad=True), f64(3, 3), f64(3, 2, requires_grad=True))
    gm = aot_export_joint_simple(_simple, args, trace_joint=True)
    tangent_names = [n.name for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    assert tangent_names == ["tangents_1", "tangents_2"]  # the detached output gets none
    forward, backward = default_partition(gm, None, num_fwd_outputs=3)
    with torch.no_grad():
        forward_values = forward(*args)
    expected = _simple(*args)
    for got, want in zip(forward_values[:3], expected):
        torch.testing.assert_close(got, want.detach())
    tangents = [f64(3, 3), f64(3, 2)]
    with torch.no_grad():
        joint_values = gm(*args, *tangents)
    want_grads = torch.autograd.grad(expected[:2], [args[0], args[2]], tangents)
    assert joint_values[3 + 1] is None  # the input that needs no gradient
    torch.testing.assert_close(joint_values[3], want_grads[0])
    torch.testing.assert_close(joint_values[5], want_grads[1])
    saved = forward_values[3:]
    with torch.no_grad():
        backward_values = backward(*saved, *tangents)
    torch.testing.assert_close(backward_values[0], want_grads[0])
    torch.testing.assert_close(backward_values[2], want_grads[1])


def test_joint_simple_matches_torch():
    """The same joint graph as PyTorch's aot_export_joint_simple (which takes its primals and
    tangents as two lists; ours takes them flat, as every aotforge joint does)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple as torch_export_simple

    args = (f64(3, 3, requires_grad=True), f64(3, 3), f64(3, 2, requires_grad=True))
    ours = aot_export_joint_simple(_simple, args, trace_joint=True)
    theirs = torch_export_simple(_simple, args, trace_joint=True)

    def body(gm):
        return [
            line.strip() for line in gm.code.strip().splitlines()[1:-1] if "tree_flatten_spec" not in line
        ]

    assert body(ours) == body(theirs)
    (their_output,) = theirs.graph.find_nodes(op="output")
    their_outputs = pytree.tree_leaves(their_output.args, is_leaf=lambda x: x is None)
    assert output_names(ours) == [getattr(n, "name", repr(n)) for n in their_outputs]


# ---------------------------------------------------------------------------------------------
# Restrictions: each error names what is wrong and says what to do


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, dtype=D))


class MetadataMutation(_Scaled):
    def forward(self, x):
        x.unsqueeze_(0)
        return (x * self.weight).sum()


class ParameterMutation(_Scaled):
    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.5)
        return (x * self.weight).sum()


class InputMutationRequiringGrad(_Scaled):
    def forward(self, x):
        y = x * 1
        x.mul_(2)
        return (y * self.weight).sum()


class BufferGetsGradient(_Scaled):
    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(3, dtype=D))

    def forward(self, x):
        self.last.copy_(self.weight * 2)
        return (x * self.weight).sum()


class TwoOutputs(_Scaled):
    def forward(self, x):
        y = x * self.weight
        return y.sum(), y


class PlainOutputs(_Scaled):
    def forward(self, x):
        y = x * self.weight
        return y, y.detach().sum()


class AttributeAssignment(_Scaled):
    def forward(self, x):
        self.cache = x * self.weight
        return self.cache.sum()


class BufferReassignedWithNewShape(_Scaled):
    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(3, dtype=D))

    def forward(self, x):
        self.running = x.detach()
        return (x * self.weight).sum()


class UnusedParameter(_Scaled):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.randn(3, dtype=D))

    def forward(self, x):
        return (x * self.weight).sum()


class ValueDependentBranch(_Scaled):
    def forward(self, x):
        if x.sum() > 0:
            return (x * self.weight).sum()
        return x.sum()


class DataDependentShape(_Scaled):
    def forward(self, x):
        return (x[x > 0] * 2).sum() + self.weight.sum()


def _export(mod, x=None, **kwargs):
    x = f64(2, 3) if x is None else x
    return lambda: aot_export_module(mod, (x,), **kwargs)


JOINT = {"trace_joint": True, "output_loss_index": 0}

RESTRICTIONS = {
    "metadata mutation": (
        _export(MetadataMutation(), trace_joint=False),
        ["metadata", "user input args[0]", "x = x.t()"],
    ),
    "mutation of a parameter that requires grad": (
        _export(ParameterMutation(), **JOINT),
        ["mutates parameter 'weight' in place", "requires grad", "requires_grad_(False)"],
    ),
    "mutation of an input that requires grad": (
        _export(InputMutationRequiringGrad(), f64(2, 3, requires_grad=True), **JOINT),
        ["mutates user input args[0] in place", "requires grad"],
    ),
    "buffer written with a value that requires grad": (
        _export(BufferGetsGradient(), **JOINT),
        ["buffer 'last'", "value.detach()"],
    ),
    "loss is not a scalar": (
        _export(PlainOutputs(), **JOINT),
        ["the loss (output 0, output_loss_index=0) has shape (2, 3)", "loss.sum()"],
    ),
    "loss does not require grad": (
        _export(PlainOutputs(), trace_joint=True, output_loss_index=1),
        ["output 1", "does not require grad"],
    ),
    "another output requires grad": (
        _export(TwoOutputs(), **JOINT),
        ["output 1 requires grad", "only the loss (output 0)", ".detach()"],
    ),
    "output_loss_index missing": (
        _export(TwoOutputs(), trace_joint=True),
        ["trace_joint=True needs output_loss_index"],
    ),
    "output_loss_index out of range": (
        _export(TwoOutputs(), trace_joint=True, output_loss_index=2),
        ["output_loss_index=2", "returned 2 output(s)"],
    ),
    "tensor attribute that is not a buffer": (
        _export(AttributeAssignment(), **JOINT),
        ["module attribute 'cache'", "not a registered buffer", "register_buffer('cache'"],
    ),
    "buffer reassigned with another shape": (
        _export(BufferReassignedWithNewShape(), **JOINT),
        ["reassigns buffer 'running'", "shape (2, 3)", "registered with shape (3,)"],
    ),
    "parameter without a gradient": (
        _export(UnusedParameter(), **JOINT),
        ["parameter 'unused' requires grad but the loss does not depend on it"],
    ),
    "python branch on a tensor value": (
        _export(ValueDependentBranch(), trace_joint=False),
        ["depends on the values inside a tensor", "torch.where"],
    ),
    "output shape that depends on data": (
        _export(DataDependentShape(), **JOINT),
        ["depends on the values inside a tensor", "nonzero, masked_select"],
    ),
    "simple: data-dependent value": (
        lambda: aot_export_joint_simple(lambda x: (x * x.max().item(),), (f64(2),), trace_joint=False),
        ["aot_export_joint_simple: the forward depends on the values inside a tensor"],
    ),
    "simple: pytree input": (
        lambda: aot_export_joint_simple(lambda xs: (xs[0] * 2,), ([f64(2)],), trace_joint=False),
        ["input 0 is a list, not a tensor", "pytree"],
    ),
    "simple: pytree output": (
        lambda: aot_export_joint_simple(lambda x: ({"y": x * 2},), (f64(2),), trace_joint=False),
        ["output 0 is a dict", "pytree"],
    ),
    "simple: bare tensor output": (
        lambda: aot_export_joint_simple(lambda x: x * 2, (f64(2),), trace_joint=False),
        ["must return a tuple or list of tensors, got a tensor", "(out,)"],
    ),
    "simple: output aliases input": (
        lambda: aot_export_joint_simple(lambda x: (x.view(-1),), (f64(2, 2),), trace_joint=True),
        ["output 0 is a view of input 0", "out.clone()"],
    ),
    "simple: output aliases output": (
        lambda: aot_export_joint_simple(lambda x: ((y := x * 2), y.t()), (f64(2, 2),), trace_joint=False),
        ["output 1 is a view of output 0", "out.clone()"],
    ),
    "simple: input mutation": (
        lambda: aot_export_joint_simple(lambda x: (x.add_(1) * 2,), (f64(2),), trace_joint=False),
        ["mutates the data (an in-place op) of input 0", "x.clone()"],
    ),
}


@pytest.mark.parametrize("case", list(RESTRICTIONS))
def test_restriction_error(case):
    export, fragments = RESTRICTIONS[case]
    with pytest.raises(ExportError) as info:
        export()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_failed_export_leaves_the_module_unchanged():
    mod = AttributeAssignment()
    with pytest.raises(ExportError):
        aot_export_module(mod, (f64(2, 3),), trace_joint=False)
    assert not hasattr(mod, "cache")
    assert not mod._forward_hooks


def test_load_rejects_other_files(tmp_path):
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ExportError, match="not written by aotforge's save_exported"):
        load_exported(tmp_path / "other.pt")


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"tuple of positional arguments, e.g. \(x,\)"):
        aot_export_module(LinearBatchNorm(), torch.randn(2, 6), trace_joint=False)
