"""save_exported / load_exported: the file is plain data, read without running any code from
it; damaged files say so; a loaded graph reproduces eager (float64) and keeps every check the
exported graph had."""
import copy
import json
import pickle

import pytest
import torch
import torch.nn as nn

from aotforge import aot_export_module, load_exported, run_exported, save_exported
from aotforge.aot import export_format
from aotforge.aot.export import ExportError

from .test_export import LinearBatchNorm, f64
from .test_export_guards import Classifier, assert_run_matches_eager, classifier_inputs

D = torch.float64


class WithConstant(nn.Module):
    """A tensor created in forward becomes a constant of the graph (a get_attr)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3, dtype=D))

    def forward(self, x):
        weights = torch.tensor([1.0, -2.0, 0.5], dtype=D)
        return (x * weights * self.scale).sum(), x[:, 1:2].detach()


class RunsCode:
    """Unpickling this object runs Python code: it creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).touch()",))


def saved_export(tmp_path, mod=None, args=None, **export_kwargs):
    mod = WithConstant() if mod is None else mod
    args = (f64(4, 3),) if args is None else args
    export_kwargs = export_kwargs or {"trace_joint": True, "output_loss_index": 0}
    gm, sig = aot_export_module(mod, args, **export_kwargs)
    path = tmp_path / "exported.pt"
    save_exported(path, gm, sig)
    return path, gm, sig


def test_round_trip_reproduces_eager_with_constants_and_names(tmp_path):
    torch.manual_seed(0)
    mod = WithConstant()
    x = f64(4, 3, requires_grad=True)
    path, gm, sig = saved_export(tmp_path, mod, (x,))
    loaded, loaded_sig = load_exported(path)
    assert loaded_sig == sig and loaded.code == gm.code
    assert [n.name for n in loaded.graph.nodes] == [n.name for n in gm.graph.nodes]
    eager = copy.deepcopy(mod)
    want_loss, want_slice = eager(x)
    want_loss.backward()
    (loss, sliced), gradients = run_exported(loaded, loaded_sig, mod, x.detach().clone())
    torch.testing.assert_close(loss, want_loss.detach())
    torch.testing.assert_close(sliced, want_slice)
    torch.testing.assert_close(gradients["scale"], eager.scale.grad)


def test_checks_stay_on_after_loading(tmp_path):
    """A batch-7 input through a graph exported for batch 5 is an error after a round trip
    too (it used to run and return a wrong loss), and so is another dtype."""
    torch.manual_seed(0)
    mod = Classifier()
    path, _, _ = saved_export(tmp_path, mod, classifier_inputs(5))
    gm, sig = load_exported(path)
    assert_run_matches_eager(gm, sig, mod, classifier_inputs(5))
    with pytest.raises(ExportError, match=r"args\[0\] has shape \(7, 16\).*exported for shape \(5, 16\)"):
        run_exported(gm, sig, mod, *classifier_inputs(7))
    x, target = classifier_inputs(5)
    with pytest.raises(ExportError, match=r"args\[0\] has shape \(5, 16\) and dtype torch.float32"):
        run_exported(gm, sig, mod, x.float(), target)


def test_dynamic_shape_checks_survive_a_round_trip(tmp_path):
    torch.manual_seed(0)
    mod = Classifier()
    path, _, _ = saved_export(
        tmp_path, mod, classifier_inputs(8), trace_joint=True, output_loss_index=0, dynamic_shapes=True
    )
    gm, sig = load_exported(path)
    assert_run_matches_eager(gm, sig, mod, classifier_inputs(11))
    with pytest.raises(ExportError, match=r"args\[0\] has shape \(5, 12\).*exported for shape \(any, 16\)"):
        run_exported(gm, sig, mod, f64(5, 12), torch.randint(0, 4, (5,)))
    with pytest.raises(AssertionError, match=r"args\[1\] size 0 must be equal to user input args\[0\] size 0"):
        run_exported(gm, sig, mod, f64(5, 16), torch.randint(0, 4, (6,)))
    with pytest.raises(AssertionError, match=r"args\[1\] size 0 must be equal"):
        gm(*mod.parameters(), *mod.buffers(), f64(5, 16), torch.randint(0, 4, (6,)))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch.save", "pickle protocol 2", "pickle protocol 4"])
def test_a_file_that_would_run_code_is_refused_without_running_it(tmp_path, writer):
    marker = tmp_path / "code_ran"
    payload = {"format": export_format.FORMAT, "version": export_format.VERSION, "x": RunsCode(marker)}
    path = tmp_path / "crafted.pt"
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as file:
            pickle.dump(payload, file, protocol=int(writer[-1]))
    # (torch's safe unpickler stops at protocol 4's first opcode, before it sees the code.)
    expected = "damaged .*nothing in it was run" if writer.endswith("4") else (
        "refused to load .*it names Python code to run on loading .*GLOBAL (builtins.)?exec.*"
        "Nothing in it was run"
    )
    with pytest.raises(ExportError, match=expected):
        load_exported(path)
    assert not marker.exists()
    # The file is a real threat: unpickling it the old way runs its code.
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as file:
            pickle.load(file)
    assert marker.exists()


def test_files_of_the_old_pickled_format_are_refused(tmp_path):
    gm, sig = aot_export_module(LinearBatchNorm().to(D), (f64(8, 6),), trace_joint=False)
    path = tmp_path / "old.pt"
    torch.save({"graph": gm, "signature": sig, "format": "aotforge-export-1"}, path)
    with pytest.raises(ExportError, match="refused to load .*GLOBAL.*older than export format version 2"):
        load_exported(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.01])
def test_truncated_files_are_damaged(tmp_path, keep):
    path, _, _ = saved_export(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ExportError, match="is damaged"):
        load_exported(path)


def test_edited_files_are_damaged(tmp_path):
    path, _, _ = saved_export(tmp_path)
    data = path.read_bytes()
    # An operator swapped for another of the same length, in the graph description.
    assert data.count(b"aten::mul.Tensor") >= 1
    path.write_bytes(data.replace(b"aten::mul.Tensor", b"aten::add.Tensor", 1))
    with pytest.raises(ExportError, match="is damaged: its contents do not match the checksum"):
        load_exported(path)
    # A byte of the constant tensor [1.0, -2.0, 0.5].
    constant = torch.tensor([1.0, -2.0, 0.5], dtype=D).numpy().tobytes()
    assert data.count(constant) == 1
    edited = bytearray(data)
    edited[data.index(constant) + 3] ^= 0x40
    path.write_bytes(bytes(edited))
    with pytest.raises(ExportError, match="is damaged: its contents do not match the checksum"):
        load_exported(path)


def test_other_files_are_not_exports(tmp_path):
    (tmp_path / "text.pt").write_text("not a torch file")
    with pytest.raises(ExportError, match="is damaged .* or is not a file save_exported wrote; nothing"):
        load_exported(tmp_path / "text.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "weights.pt")
    with pytest.raises(ExportError, match="not written by aotforge's save_exported"):
        load_exported(tmp_path / "weights.pt")
    with pytest.raises(FileNotFoundError):
        load_exported(tmp_path / "missing.pt")


def rewrite_description(path, edit) -> None:
    """Re-save ``path`` with its description edited and a matching checksum: what someone
    crafting a file could do."""
    saved = torch.load(path, weights_only=True)
    description = json.loads(saved["description"])
    edit(description)
    saved["description"] = json.dumps(description)
    saved["checksum"] = export_format.checksum(saved["description"], saved["constants"])
    torch.save(saved, path)


def first_call(description, op_name):
    return next(
        node for node in description["graph"]["nodes"] if node.get("target") == {"op": op_name}
    )


@pytest.mark.parametrize(
    "target, message",
    [
        ({"function": "os.system"}, "call of 'os.system', which is not a function export graphs use"),
        ({"function": "builtins.exec"}, "call of 'builtins.exec'"),
        ({"op": "aten::__class__.default"}, "'__class__' is not an operator name"),
        ({"op": "aten::mul.__init__"}, "'__init__' is not an operator name"),
        ({"higher_order": "__globals__"}, "'__globals__' is not an operator name"),
        ({"python": "eval"}, "call target"),
    ],
)
def test_crafted_descriptions_only_resolve_operators(tmp_path, target, message):
    """Even with a valid checksum, a node can only call registered operators and the few
    Python functions the format lists."""
    path, _, _ = saved_export(tmp_path)

    def edit(description):
        first_call(description, "aten::mul.Tensor")["target"] = target

    rewrite_description(path, edit)
    with pytest.raises(ExportError, match="is damaged: its graph description is invalid") as info:
        load_exported(path)
    assert message in str(info.value)


def test_an_unregistered_operator_says_what_to_import(tmp_path):
    path, _, _ = saved_export(tmp_path)

    def edit(description):
        first_call(description, "aten::mul.Tensor")["target"] = {"op": "mylib::scale.default"}

    rewrite_description(path, edit)
    with pytest.raises(ExportError, match="calls operator mylib::scale.default, which is not registered"):
        load_exported(path)


def test_saving_what_the_format_cannot_hold_is_an_error(tmp_path):
    gm, sig = aot_export_module(LinearBatchNorm().to(D), (f64(8, 6),), trace_joint=False)
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.relu  # a Python function outside the format's list
    with pytest.raises(ExportError, match="node 'relu' calls .*which the export format does not store"):
        save_exported(tmp_path / "bad.pt", gm, sig)
