"""Export names: graph inputs are named arg0_1, arg1_1, ... and the signature's maps use the
same names as PyTorch's aot_export_module, so code written against PyTorch's signature works
unchanged (compared with PyTorch's export, and run against eager in float64)."""
import pytest
import torch
import torch.nn as nn

from aotforge import aot_export_module

from .test_export import ConvBatchNorm, LinearBatchNorm, assert_matches_eager, f64, loss_at, output_names

D = torch.float64


def torch_signature_fields(signature) -> dict:
    """The fields both signatures have (PyTorch's adds effect tokens, which exports here
    never have)."""
    fields = dict(vars(signature))
    fields.pop("backward_signature")
    fields.pop("input_tokens", None), fields.pop("output_tokens", None)
    return fields


class InputMutationAndInputGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3, dtype=D)
        self.register_buffer("seen", torch.zeros(3, dtype=D))

    def forward(self, x, scale):
        self.seen.add_(x.detach().sum(0))
        scale.mul_(2)
        hidden = self.proj(x) * scale
        return hidden.sum(), hidden.detach()


@pytest.mark.parametrize(
    "make_model, make_args",
    [
        (lambda: LinearBatchNorm().to(D), lambda: (f64(8, 6),)),
        (lambda: ConvBatchNorm().to(D), lambda: (f64(4, 2, 5, 5), torch.tensor([0, 1, 1, 0]))),
        (InputMutationAndInputGradient, lambda: (f64(2, 3, requires_grad=True), f64(3))),
    ],
    ids=["linear_batchnorm", "conv_batchnorm", "input_mutation_and_gradient"],
)
@pytest.mark.parametrize("trace_joint", [True, False], ids=["joint", "inference"])
def test_names_are_torchs(make_model, make_args, trace_joint):
    """Graph inputs are named arg0_1, arg1_1, ... as PyTorch's aot_export_module names them, so
    the signature's maps (input -> parameter / buffer, output -> buffer / input / gradient)
    are PyTorch's, name for name."""
    from torch._functorch.aot_autograd import aot_export_module as torch_export

    torch.manual_seed(0)
    mod, args = make_model(), make_args()
    ours, our_sig = aot_export_module(mod, args, **loss_at(0, trace_joint))
    theirs, their_sig = torch_export(mod, args, **loss_at(0, trace_joint))
    placeholder_names = [n.name for n in ours.graph.find_nodes(op="placeholder")]
    assert placeholder_names == [f"arg{i}_1" for i in range(len(placeholder_names))]
    assert placeholder_names == [n.name for n in theirs.graph.find_nodes(op="placeholder")]
    if trace_joint:
        # Node numbering differs where PyTorch's joint keeps a dead detach; compare the maps
        # that name inputs exactly and the outputs by what they are.
        for field in ("parameters", "buffers", "user_inputs", "inputs_to_parameters", "inputs_to_buffers"):
            assert getattr(our_sig, field) == getattr(their_sig, field), field
        ours_by_position = dict(zip(output_names(ours), range(999)))
        theirs_by_position = dict(zip(output_names(theirs), range(999)))
        for field in ("buffers_to_mutate", "user_inputs_to_mutate"):
            assert {ours_by_position[k]: v for k, v in getattr(our_sig, field).items()} == {
                theirs_by_position[k]: v for k, v in getattr(their_sig, field).items()
            }, field
        ours_backward, theirs_backward = our_sig.backward_signature, their_sig.backward_signature
        assert {ours_by_position[k]: v for k, v in ours_backward.gradients_to_parameters.items()} == {
            theirs_by_position[k]: v for k, v in theirs_backward.gradients_to_parameters.items()
        }
        assert {ours_by_position[k]: v for k, v in ours_backward.gradients_to_user_inputs.items()} == {
            theirs_by_position[k]: v for k, v in theirs_backward.gradients_to_user_inputs.items()
        }
        # PyTorch's loss_output indexes the outputs without skipping the updated buffers in
        # front of them (for BatchNorm it names a running-statistics update); ours names the
        # loss itself.
        assert ours_backward.loss_output == our_sig.user_outputs[0]
    else:
        assert torch_signature_fields(our_sig) == torch_signature_fields(their_sig)
        assert output_names(ours) == output_names(theirs)
    assert_matches_eager(ours, our_sig, mod, args, loss_index=0 if trace_joint else None)
