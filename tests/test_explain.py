"""``python -m aotforge explain``: loads a model from a file, exports it and prints the
signature and graphs. The example models live in tests/explain_example.py."""
import os
import sys

import pytest
import torch

from aotforge import aot_export_module
from aotforge.explain import _partition, load_model, main, parse_input

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "explain_example.py")


def run_main(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_joint_explain_prints_signature_and_three_graphs(capsys):
    code, out, _ = run_main(
        capsys, "--model", f"{EXAMPLE}:TinyClassifier", "--input", "8x16", "--input", "8:int64:4",
        "--joint", "--loss-index", "0",
    )
    assert code == 0
    for line in (
        "model: TinyClassifier (training mode), inputs: (8, 16) float32, (8,) int64",
        "parameter encoder.weight",
        "buffer    norm.running_mean",
        "user input args[1]",
        "new value of buffer norm.num_batches_tracked",
        "user output 0 (the loss)",
        "gradient of parameter head.bias",
        "==== joint graph (forward + backward of the loss) ====",
        "==== forward graph (default partition) ====",
        "saved for the backward (13 values, 1.5 KiB): ",
        "==== backward graph (default partition) ====",
        'def forward(self, arg0_1: "f32[8, 16]"',
    ):
        assert line in out, line
    assert "class " not in out and "No stacktrace" not in out
    # The backward returns the gradients, in the signature's order.
    signature_gradients = [
        line.split()[0] for line in out.splitlines() if "gradient of parameter" in line
    ]
    backward_section = out.split("==== backward graph (default partition) ====")[1]
    returned = backward_section.strip().splitlines()[-1].strip()
    assert returned == f"return ({', '.join(signature_gradients)})"


def test_inference_explain_with_factory_and_dtype(capsys):
    code, out, _ = run_main(capsys, "--model", f"{EXAMPLE}:make_encoder", "--input", "4x16", "--dtype", "float64")
    assert code == 0
    assert "==== forward graph (inference) ====" in out and "joint" not in out
    assert "tanh: \"f64[4, 8]\"" in out
    assert "user output 0\n" in out


def test_dynamic_explain_shows_symbolic_sizes_and_checks(capsys):
    code, out, _ = run_main(
        capsys, "--model", f"{EXAMPLE}:TinyClassifier", "--input", "8x16", "--input", "8:int64:4",
        "--joint", "--loss-index", "0", "--dynamic",
    )
    assert code == 0
    assert "user input args[0] size 1 must be 16" in out
    assert 'arg9_1: "f32[s' in out  # the batch size is a symbol


def test_partition_of_an_export_joint_matches_eager():
    """What explain prints as forward and backward is a working split: run it on real
    tensors and compare gradients with eager."""
    torch.manual_seed(0)
    model = load_model(f"{EXAMPLE}:TinyClassifier").double()
    x, target = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8,))
    gm, signature = aot_export_module(model, (x, target), trace_joint=True, output_loss_index=0)
    forward, backward = _partition(gm, signature)
    flat = [*model.parameters(), *model.buffers(), x, target]
    with torch.no_grad():
        forward_values = forward(*flat)
        num_outputs = 3 + 2  # three buffer updates, two user outputs
        gradients = backward(*forward_values[num_outputs:])
    eager_loss, _ = model(x, target)
    eager_loss.backward()
    torch.testing.assert_close(forward_values[3], eager_loss.detach())
    for gradient, parameter in zip(gradients, model.parameters()):
        torch.testing.assert_close(gradient, parameter.grad)


def test_command_line_entry_point(capsys):
    """``python -m aotforge explain ...`` dispatches here (in-process: a new interpreter
    would cost CI seconds for the import alone)."""
    from aotforge.cli import main as cli_main

    assert cli_main(["explain", "--model", f"{EXAMPLE}:TinyEncoder", "--input", "2x16"]) == 0
    out = capsys.readouterr().out
    assert "parameter proj.weight" in out and "forward graph (inference)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "8x16", "--joint"], "--joint needs --loss-index N"),
        (["--input", "8x16", "--loss-index", "0"], "--loss-index applies only with --joint"),
        (["--input", "8y16"], "'8y16' is not sizes joined by 'x'"),
        (["--input", "8:complex"], "unknown dtype 'complex'"),
        (["--input", "8:float32:3"], "HIGH applies to integer inputs only"),
    ],
)
def test_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["--model", f"{EXAMPLE}:TinyEncoder", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_model_file_may_import_its_neighbours(tmp_path, capsys):
    (tmp_path / "layers.py").write_text(
        "import torch\nclass Scale(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(3))\n"
        "    def forward(self, x):\n        return x * self.weight\n"
    )
    (tmp_path / "model.py").write_text("from layers import Scale\n\ndef build():\n    return Scale()\n")
    try:
        code, out, _ = run_main(capsys, "--model", f"{tmp_path / 'model.py'}:build", "--input", "2x3")
    finally:
        sys.modules.pop("layers", None)
    assert code == 0 and "parameter weight" in out


def test_constructor_arguments_from_init(capsys):
    code, out, _ = run_main(
        capsys, "--model", f"{EXAMPLE}:TinyClassifier", "--init", '{"features": 5, "hidden": 3}',
        "--input", "4x5", "--input", "4:int64:4", "--joint", "--loss-index", "0",
    )
    assert code == 0 and '"f32[3, 5]"' in out  # encoder.weight is hidden x features
    with pytest.raises(SystemExit):
        main(["--model", f"{EXAMPLE}:TinyClassifier", "--init", '{"width": 3}', "--input", "4x5"])
    assert "unexpected keyword argument 'width'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", f"{EXAMPLE}:TinyClassifier", "--init", "{width: 3}", "--input", "4x5"])
    assert "is not valid JSON" in capsys.readouterr().err


def test_model_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--model", f"{EXAMPLE}:Missing", "--input", "2x16"])
    assert "defines no 'Missing'; modules defined there: TinyClassifier, TinyEncoder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "no/such/file.py:Model", "--input", "2x16"])
    assert "no such file" in capsys.readouterr().err


def test_export_error_is_reported_with_exit_code_1(capsys):
    # Output 1 (the detached logits) does not require grad, so it cannot be the loss.
    code, out, err = run_main(
        capsys, "--model", f"{EXAMPLE}:TinyClassifier", "--input", "8x16", "--input", "8:int64:4",
        "--joint", "--loss-index", "1",
    )
    assert code == 1 and out == ""
    assert "cannot be exported" in err and "output_loss_index=1) does not require grad" in err


def test_parse_input():
    integers = parse_input("8:int64:100", torch.float32)
    assert integers.shape == (8,) and integers.dtype == torch.int64
    assert 0 <= integers.min() and integers.max() < 100
    assert parse_input("scalar", torch.float64).shape == ()
    assert parse_input("2x3x4", torch.float16).dtype == torch.float16
    assert parse_input("5:bool", torch.float32).dtype == torch.bool
