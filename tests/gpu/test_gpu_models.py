"""Real models on CUDA through ``torch.compile(backend="aotforge")``: the three failures that
kept most model families from training on a GPU (issue 30), each as its smallest reproduction,
and a few families of the ``families`` bench suite against eager (the suite itself:
``bash benchmarks/gpu_bench.sh families``)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and compiled, not interpreted, Triton)")

import aotforge  # noqa: E402,F401  (registers the backend)
from aotforge.bench import runner  # noqa: E402
from aotforge.bench.suites import load_workloads  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_is_float32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch._dynamo.reset()


def _close(actual, expected, tolerance=1e-4):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item() < tolerance


def _train_both(model: nn.Module, *inputs, loss=lambda out: out):
    eager, compiled = model, copy.deepcopy(model)
    expected = loss(eager(*inputs))
    expected.backward()
    actual = loss(torch.compile(compiled, backend="aotforge")(*inputs))
    actual.backward()
    assert _close(actual, expected)
    for (name, a), (_, e) in zip(compiled.named_parameters(), eager.named_parameters()):
        assert (a.grad is None) == (e.grad is None), name
        if e.grad is not None:
            assert _close(a.grad, e.grad), name


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_random_state_outputs_live_on_the_cpu(dropout):
    """The memory-efficient attention kernel returns its philox seed and offset as 0-d int64
    CPU tensors where the fake kernel says CUDA: the compiled forward used to fail its output
    check ("returned output 33 as () torch.int64 on cpu, but the graph returns ... cuda:0")."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, attn_pdrop=dropout,
                                     resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).cuda()
    ids = torch.randint(0, 1000, (2, 32), device="cuda")
    if dropout == 0.0:
        _train_both(model, ids, loss=lambda out: out.logits.float().pow(2).mean())
        return
    # with dropout the masks differ from eager's; the step must run, and its gradients exist
    compiled = torch.compile(model, backend="aotforge")
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_cpu_scalar_tensor_in_cuda_arithmetic():
    """``t * torch.tensor(2.0)``: eager reads the CPU 0-d tensor as a number; a Triton kernel
    was handed it as a pointer ("Pointer argument (at 1) cannot be accessed from Triton")."""
    def f(t):
        return (t * torch.tensor(2.0)).sin() + torch.tensor(3, dtype=torch.int64)

    t = torch.randn(1000, device="cuda")
    torch.testing.assert_close(torch.compile(f, backend="aotforge")(t), f(t))


def test_cpu_scalar_inputs_step_counter_and_learning_rate():
    """A 0-d CPU tensor passed in (an optimizer's step count, a learning rate kept as a
    tensor), read by CUDA kernels and itself updated on the CPU."""
    def step(weight, grad, lr, count):
        count.add_(1)
        weight.sub_(lr * grad / count)
        return weight.sum()

    weight, grad = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    lr, count = torch.tensor(0.1), torch.tensor(0.0)
    weight2, lr2, count2 = weight.clone(), lr.clone(), count.clone()
    compiled = torch.compile(step, backend="aotforge")
    for _ in range(3):
        expected = step(weight, grad, lr, count)
        actual = compiled(weight2, grad, lr2, count2)
        torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(weight2, weight)
    assert count2.device.type == "cpu" and count2.item() == count.item() == 3


def test_adamw_with_tensor_learning_rate():
    torch.manual_seed(0)
    model = nn.Linear(64, 64).cuda()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    opt2 = torch.optim.AdamW(twin.parameters(), lr=torch.tensor(1e-3))
    x = torch.randn(8, 64, device="cuda")

    @torch.compile(backend="aotforge")
    def compiled_step():
        opt2.step()

    for _ in range(3):
        for m in (model, twin):
            m.zero_grad()
            m(x).square().mean().backward()
        opt.step()
        compiled_step()
    for a, b in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)


def test_vit_patch_embedding_inference_with_channels_last_pass():
    """The channels-last pass failed in its fake-value propagation on ViT's and Swin's patch
    embeddings (a 3-channel convolution, then a flatten)."""
    class PatchEmbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.head = nn.Conv2d(3, 64, 16, 16), nn.Linear(64, 10)
            self.mix = nn.Conv2d(64, 64, 1)

        def forward(self, x):
            x = self.mix(self.proj(x))
            return self.head(x.flatten(2).transpose(1, 2)).mean(1)

    model = PatchEmbed().cuda().eval()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="aotforge")(x), model(x), rtol=1e-4, atol=1e-4)


FAMILIES = ["fam_gpt2", "fam_t5", "fam_deberta_v2", "fam_vit", "fam_swin_t", "fam_llama_checkpointed"]


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", FAMILIES)
def test_model_family_matches_eager(name, mode):
    workload = {w.name: w for w in load_workloads()}[name]
    if workload.missing_packages():
        pytest.skip(f"needs {workload.missing_packages()}")
    torch.manual_seed(0)
    case = workload.build(mode, False)
    device = torch.device("cuda")
    eager = runner.run_eager_once(case, mode, device, torch.float32)
    reference = runner.run_eager_once(case, mode, device, torch.float64)
    allowed = runner.measure.allowed_errors(eager, reference, torch.float32)
    module, inputs = runner.prepare(case, mode, device, torch.float32)
    step = runner.make_step(runner.compile_module("aotforge", module), module, inputs, mode)
    actual = runner.snapshot(step(), module, inputs, to_cpu=True)
    _, mismatch = runner.measure.compare(actual, eager, allowed)
    assert mismatch is None, mismatch
