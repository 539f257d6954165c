"""aot_module never reuses a graph after Python state its forward read changed (issue 26):
globals, attributes of any kind (lists, tuples, dicts, functions, tensors, config objects),
class attributes and the forward itself. Each case compares with eager before and after the
change, and checks that the change compiled a new graph (not a lucky equal value)."""
import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from aotforge import aot_function, aot_module, nop

D = torch.float64
FACTOR = 2.0
TABLE = {"scale": 2.0}


def _scaled(x):
    return x * FACTOR


@dataclasses.dataclass
class Config:
    scale: float = 2.0
    unused: list = dataclasses.field(default_factory=lambda: list(range(1000)))


class Net(torch.nn.Module):
    """Reads one kind of Python state in its forward, chosen by ``kind``."""

    class_scale = 2.0

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(3, 3).double()
        self.factors = [1.0, 2.0]
        self.shape = (2, 3)
        self.options = {"scale": 2.0}
        self.activation = torch.relu
        self.offset = torch.tensor(1.0, dtype=D)
        self.config = Config()

    def forward(self, x):
        y = self.linear(x)
        if self.kind == "global":
            return y * FACTOR
        if self.kind == "helper_global":
            return _scaled(y)
        if self.kind == "global_dict":
            return y * TABLE["scale"]
        if self.kind == "list":
            return y * self.factors[1]
        if self.kind == "tuple":
            return y.reshape(self.shape)
        if self.kind == "dict":
            return y * self.options["scale"]
        if self.kind == "activation":
            return self.activation(y)
        if self.kind == "tensor":
            return y + self.offset
        if self.kind == "config":
            return y * self.config.scale
        if self.kind == "class_attribute":
            return y * self.class_scale
        return y


def _set_global(name, value):
    globals()[name] = value


def _alternative_forward(self, x):
    return self.linear(x).tanh()


# kind the forward reads -> the change made after the first call
CHANGES = {
    "global": ("global", lambda m: _set_global("FACTOR", 5.0)),
    "helper_global": ("helper_global", lambda m: _set_global("FACTOR", 5.0)),
    "global_dict": ("global_dict", lambda m: TABLE.__setitem__("scale", 5.0)),
    "list_mutated": ("list", lambda m: m.factors.__setitem__(1, 5.0)),
    "list_rebound": ("list", lambda m: setattr(m, "factors", [1.0, 5.0])),
    "tuple_rebound": ("tuple", lambda m: setattr(m, "shape", (3, 2))),
    "dict_mutated": ("dict", lambda m: m.options.__setitem__("scale", 5.0)),
    "dict_rebound": ("dict", lambda m: setattr(m, "options", {"scale": 5.0})),
    "activation_swapped": ("activation", lambda m: setattr(m, "activation", torch.tanh)),
    "tensor_rebound": ("tensor", lambda m: setattr(m, "offset", torch.tensor(4.0, dtype=D))),
    "tensor_mutated": ("tensor", lambda m: m.offset.fill_(4.0)),
    "config_field": ("config", lambda m: setattr(m.config, "scale", 5.0)),
    "config_rebound": ("config", lambda m: setattr(m, "config", Config(scale=5.0))),
    "class_attribute": ("class_attribute", lambda m: setattr(Net, "class_scale", 5.0)),
    "instance_shadows_class_attribute": ("class_attribute", lambda m: setattr(m, "class_scale", 5.0)),
    "forward_monkeypatched": ("plain", lambda m: setattr(m, "forward", types.MethodType(_alternative_forward, m))),
    "class_forward_monkeypatched": ("plain", lambda m: setattr(Net, "forward", _alternative_forward)),
    "int_to_float": ("dict", lambda m: m.options.__setitem__("scale", 2)),
}


@pytest.fixture(autouse=True)
def _restore_state():
    forward, class_scale = Net.forward, Net.class_scale
    yield
    Net.forward, Net.class_scale = forward, class_scale
    _set_global("FACTOR", 2.0)
    TABLE["scale"] = 2.0


def _compiles(compiled) -> int:
    return sum(len(call._aotforge_cache) for call in compiled._aotforge_calls.values())


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("training", [False, True])
def test_aot_module_recompiles_after_python_state_changes(change, training):
    kind, apply_change = CHANGES[change]
    torch.manual_seed(0)
    model = Net(kind)
    compiled = aot_module(model, nop, nop)
    x = torch.randn(2, 3, dtype=D)

    def check(when):
        with torch.set_grad_enabled(training):
            expected = model(x)
            out = compiled(x)
            torch.testing.assert_close(out, expected, msg=lambda m: f"{when} {change}: {m}")
            if training:
                grads = torch.autograd.grad(out.sum(), list(model.parameters()))
                expected_grads = torch.autograd.grad(expected.sum(), list(model.parameters()))
                torch.testing.assert_close(grads, expected_grads)

    check("before")
    check("again")
    assert _compiles(compiled) == 1, "an unchanged module must reuse its graph"
    apply_change(model)
    check("after")
    assert _compiles(compiled) == 2, f"{change} must compile a new graph"
    check("after, again")
    assert _compiles(compiled) == 2


def test_submodule_swapped_for_another_class_recompiles():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3).double(), torch.nn.Sigmoid())
    compiled = aot_module(model, nop, nop)
    x = torch.randn(2, 3, dtype=D)
    torch.testing.assert_close(compiled(x), model(x))
    model[1] = torch.nn.Tanh()
    torch.testing.assert_close(compiled(x), model(x))


def test_submodule_attribute_read_through_getattr_recompiles():
    class Gated(torch.nn.Module):
        def forward(self, x):
            return x * getattr(self, "gain", 1.0)

    model = Gated()
    compiled = aot_module(model, nop)
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(compiled(x), model(x))
    model.gain = 3.0
    torch.testing.assert_close(compiled(x), model(x))


def test_forward_calling_a_method_that_reads_state_recompiles():
    class WithHelper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.negative_slope = 0.1

        def act(self, x):
            return F.leaky_relu(x, self.negative_slope)

        def forward(self, x):
            return self.act(x)

    model = WithHelper()
    compiled = aot_module(model, nop)
    x = torch.randn(5, dtype=D)
    torch.testing.assert_close(compiled(x), model(x))
    model.negative_slope = 0.5
    torch.testing.assert_close(compiled(x), model(x))


GLOBAL_CONFIG = Config()


def test_aot_function_guards_its_own_globals_closure_and_helpers():
    values = [2.0]

    def f(x):
        return _scaled(x) * values[0] * TABLE["scale"] * GLOBAL_CONFIG.scale

    compiled = aot_function(f, nop)
    x = torch.randn(3, dtype=D)
    changes = {
        "closed-over list": lambda: values.__setitem__(0, 3.0),
        "global dict": lambda: TABLE.__setitem__("scale", 4.0),
        "global read by a helper": lambda: _set_global("FACTOR", 5.0),
        "field of a global object": lambda: setattr(GLOBAL_CONFIG, "scale", 6.0),
    }
    try:
        torch.testing.assert_close(compiled(x), f(x))
        for number, (what, change) in enumerate(changes.items(), start=2):
            change()
            torch.testing.assert_close(compiled(x), f(x), msg=lambda m: f"{what}: {m}")
            assert len(compiled._aotforge_cache) == number, what
    finally:
        _set_global("FACTOR", 2.0)
        TABLE["scale"] = 2.0
        GLOBAL_CONFIG.scale = 2.0


def test_forward_changing_state_it_reads_is_a_clear_error():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, x):
            self.seen.append(x.shape[0])
            return x * len(self.seen)

    with pytest.raises(RuntimeError, match="changed Python state that it reads .* while it was traced"):
        aot_module(Counting(), nop)(torch.randn(3, dtype=D))


def _reads_a_later_global(x):
    return x * LATER  # noqa: F821  (defined by the test after compiling)


def test_aot_function_guards_a_global_defined_after_it_was_made():
    compiled = aot_function(_reads_a_later_global, nop)
    x = torch.randn(3, dtype=D)
    try:
        for value in (2.0, 5.0):
            _set_global("LATER", value)
            torch.testing.assert_close(compiled(x), _reads_a_later_global(x))
    finally:
        globals().pop("LATER", None)


# torch's own modules: caches of their parameters (an LSTM's _flat_weights), dropout
# probabilities, flags. Guarding what they read must never recompile a training loop.
ZOO = {
    "lstm": (lambda: torch.nn.LSTM(3, 4, num_layers=2), lambda: (torch.randn(5, 2, 3, dtype=D),)),
    "multihead_attention": (lambda: torch.nn.MultiheadAttention(8, 2, batch_first=True),
                            lambda: (torch.randn(2, 5, 8, dtype=D),) * 3),
    "transformer_encoder": (lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False),
        lambda: (torch.randn(2, 5, 8, dtype=D),)),
    "conv_batchnorm": (lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 2)), lambda: (torch.randn(2, 3, 8, 8, dtype=D),)),
    "spectral_norm": (lambda: torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4)),  # its hook assigns .weight
                      lambda: (torch.randn(2, 4, dtype=D),)),
    "weight_norm": (lambda: torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4)),
                    lambda: (torch.randn(2, 4, dtype=D),)),
}


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("name", sorted(ZOO))
def test_torch_modules_train_like_eager_with_one_compile(name):
    make, inputs = ZOO[name]
    torch.manual_seed(0)
    model = make().double()
    reference = make().double()
    reference.load_state_dict(model.state_dict())
    compiled = aot_module(model, nop, nop)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        args = inputs()
        out, expected = _first(compiled(*args)), _first(reference(*args))
        torch.testing.assert_close(out, expected, msg=lambda m: f"step {step}: {m}")
        for value, optimizer in zip((out, expected), optimizers):
            value.pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()))
    assert _compiles(compiled) == 1
