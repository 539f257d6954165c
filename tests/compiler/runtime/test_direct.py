"""The direct launch path (runtime/direct.py) on the CPU, with a stand-in for Triton's compiled
kernel: what reaches the launcher, when a call site launches directly and when it goes back
through the shared kernel's own run (first launches, unaligned views, a launcher that refuses
its arguments). The GPU tests (tests/gpu) run the same path against real kernels."""
from __future__ import annotations

import torch

from aotforge.compiler.runtime import direct


class FakeCompiled:
    """What Triton's ``JITFunction.run`` returns, as far as a direct launch uses it."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def run(self, *launch_args):
        if self.refuse:
            raise TypeError("this launcher takes other arguments")
        self.calls.append(launch_args)


class FakeKernel:
    """A shared kernel: its run goes through 'Triton's dispatch' (counted) and, from its second
    call on, remembers a direct launch per specialization as launch.Kernel does on a GPU."""

    def __init__(self, compiled: FakeCompiled) -> None:
        self.compiled, self.dispatched = compiled, []
        self.direct = direct.DirectLauncher()

    def run(self, *args):
        key, launch = self.direct.get(args) if self.direct is not None else (None, None)
        if launch is not None:
            try:
                launch(args)
                return
            except TypeError:
                self.direct = None
        self.dispatched.append(args)
        if self.direct is not None and key not in self.direct.launches:
            launch = direct.make_launch(self.compiled, lambda a: 7, (128, 16), device=3,
                                        current_stream=lambda device: 1000 + device)
            self.direct.launches[key] = launch


def buffers(*numels, offset=0):
    return [torch.zeros(n + 8)[offset:offset + n] for n in numels]


def test_aligned_call_launches_directly_with_the_bound_stream_and_tail():
    compiled = FakeCompiled()
    site = direct.CallSite(FakeKernel(compiled))
    a, b = buffers(128, 128)
    site.run(a, b)  # through the dispatch; the kernel remembers a direct launch
    assert site.launch is not None and len(site.kernel.dispatched) == 1
    site.run(a, b)
    site.run(b, a)
    assert len(site.kernel.dispatched) == 1  # both later calls launched directly
    assert compiled.calls == [(7, 1, 1, 1003, "function", "metadata", None, None, None, a, b, 128, 16),
                              (7, 1, 1, 1003, "function", "metadata", None, None, None, b, a, 128, 16)]


def test_unaligned_view_goes_through_the_kernel_and_is_launched_as_it_is():
    compiled = FakeCompiled()
    site = direct.CallSite(FakeKernel(compiled))
    a, b = buffers(128, 128)
    site.run(a, b)
    (odd,) = buffers(128, offset=1)  # 4 bytes past a 16-byte boundary
    assert odd.data_ptr() % 16 != 0
    site.run(odd, b)
    assert site.kernel.dispatched[-1][0] is odd  # Triton's dispatch specializes for it
    site.run(a, b)
    assert compiled.calls[-1][9:11] == (a, b)


def test_first_call_unaligned_binds_later():
    site = direct.CallSite(FakeKernel(FakeCompiled()))
    (odd,) = buffers(64, offset=1)
    site.run(odd)
    assert site.launch is None  # nothing bound for an unaligned call
    (even,) = buffers(64)
    site.run(even)
    assert site.launch is not None


def test_launcher_that_refuses_its_arguments_falls_back_to_dispatch():
    compiled = FakeCompiled(refuse=True)
    site = direct.CallSite(FakeKernel(compiled))
    a, b = buffers(32, 32)
    site.run(a, b)
    site.run(a, b)  # the direct launch raises TypeError before launching: dispatch instead
    assert site.launch is None and site.kernel.direct is None
    site.run(a, b)
    assert len(site.kernel.dispatched) == 3


def test_kernels_without_a_direct_launcher_always_dispatch():
    kernel = FakeKernel(FakeCompiled())
    kernel.direct = None  # the interpreter, a profiler's launch hooks, the C++ path
    site = direct.CallSite(kernel)
    a = torch.zeros(16)
    for _ in range(3):
        site.run(a)
    assert len(kernel.dispatched) == 3 and site.launch is None


def test_call_sites_of_one_kernel_bind_separately_by_dtype():
    """A kernel shared by two graphs may see other dtypes in each: each call site binds the
    launch of its own specialization."""
    kernel = FakeKernel(FakeCompiled())
    first, second = direct.CallSite(kernel), direct.CallSite(kernel)
    first.run(torch.zeros(16))
    second.run(torch.zeros(16, dtype=torch.float64))
    assert first.launch is not None and second.launch is not None and first.launch is not second.launch
