"""bench --profile: kernel names sorted into categories, and a profile of a CPU step."""
from __future__ import annotations

import pytest
import torch

from aotforge.bench import profile


@pytest.mark.parametrize("name, expected", [
    ("aot_pointwise_0123456789abcdef", "generated"),
    ("aot_persistent_0123456789abcdef", "generated"),
    ("triton_red_fused__log_softmax_0", "generated"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "library"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_nn", "library"),
    ("cudnn::cnn::conv2d_grouped_direct_kernel", "library"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "copies"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "library"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies"),
    ("void at::native::(anonymous namespace)::indexing_backward_kernel<float>", "other"),
])
def test_kernel_names_fall_into_categories(name, expected):
    assert profile.category(name) == expected


def test_profile_of_a_cpu_step_measures_host_time_and_operators():
    x = torch.randn(64, 64)
    result = profile.profile_step(lambda: (x @ x).relu().sum(), torch.device("cpu"), steps=3)
    assert result.host_ms > 0 and result.launches >= 3  # mm, relu, sum per step
    assert set(result.device_ms) == set(profile.CATEGORIES) and result.total_device_ms() == 0
    text = profile.table([("tiny", "infer", "eager", result)])
    assert "| tiny | infer | eager |" in text


def test_a_backend_may_name_a_torch_compile_mode(monkeypatch):
    from aotforge.bench import runner

    seen = {}
    monkeypatch.setattr(torch, "compile", lambda module, backend, mode=None: seen.update(backend=backend, mode=mode))
    runner.check_backends(["inductor:reduce-overhead", "aotforge:max-autotune", "eager"])
    runner.compile_module("aotforge:reduce-overhead", torch.nn.Linear(2, 2))
    assert seen == {"backend": "aotforge", "mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="unknown backend"):
        runner.check_backends(["nonsense:reduce-overhead"])
