"""``aotforge::philox_rand``: counter-based uniform random numbers, a pure function of a seed.

    philox_rand(seed, offset, size, dtype)[i] = uniform(philox4x32_10(key=seed, counter=offset + i))

for ``i`` the row-major linear index. Because it is a function of its arguments (no generator
state), a random op rewritten into it (functionalized RNG, aot/rng.py) can be recomputed in the
backward and give the forward's numbers bit for bit, and the compiler can generate the numbers
inside its kernels (``tl.rand(seed, offset + i)``, compiler/lowering/random.py).

The reference implementation below is Triton's ``tl.rand`` written with int64 torch ops
(uint32 arithmetic emulated with masks), so that ATen execution (aotforge_eager, any
compiler that runs ops as they are) and generated kernels draw the same numbers: PyTorch has
no counter-based generator on the CPU. It runs on any device.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Philox4x32 constants (Salmon et al. 2011; the same as Triton's and curand's)
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
ROUNDS = 10
# int32 -> [0, 1): Triton's scale, the largest float32 with (2**31 - 1) * scale < 1
UNIFORM_SCALE = 4.6566127342e-10

_library = torch.library.Library("aotforge", "FRAGMENT")  # noqa: TOR901
_library.define("philox_rand(Tensor seed, SymInt offset, SymInt[] size, ScalarType dtype) -> Tensor")


def _mulhilo(constant: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``constant * value`` for uint32 values held in int64,
    without overflowing int64: split ``value`` into 16-bit halves."""
    low_half, high_half = value & 0xFFFF, value >> 16
    partial_low = constant * low_half  # < 2**48
    partial_high = constant * high_half  # < 2**48
    high = (partial_high + (partial_low >> 16)) >> 16
    low = (((partial_high & 0xFFFF) << 16) + partial_low) & MASK32
    return high, low


def philox_uint32(seed: int | torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The first 32-bit output of Philox4x32-10 per counter (int64 tensor of values in
    [0, 2**64)), keyed by the 64-bit ``seed``: Triton's ``randint(seed, counter)``."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=counters.device)
    key0, key1 = seed & MASK32, (seed >> 32) & MASK32
    c0, c1 = counters & MASK32, (counters >> 32) & MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(ROUNDS):
        high_b, low_b = _mulhilo(ROUND_B, c2)
        high_a, low_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ key0, low_b, high_a ^ c3 ^ key1, low_a
        key0 = (key0 + KEY_A) & MASK32
        key1 = (key1 + KEY_B) & MASK32
    return c0


def uint32_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float``: reinterpret as int32, fold negatives onto
    non-negatives (``~x``), scale into [0, 1) in float32."""
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    folded = torch.where(signed < 0, -signed - 1, signed)
    return folded.to(torch.int32).to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def philox_rand_reference(seed: torch.Tensor, offset: int, size: list, dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for dim in size:
        numel *= dim
    counters = torch.arange(numel, dtype=torch.int64, device=seed.device) + offset
    uniform = uint32_to_uniform(philox_uint32(seed.to(torch.int64), counters))
    return uniform.to(dtype).reshape(size)


def _fake(seed: torch.Tensor, offset, size, dtype):
    return seed.new_empty(size, dtype=dtype)


def _philox_rand_cuda(seed: torch.Tensor, offset: int, size: list, dtype: torch.dtype) -> torch.Tensor:
    """On CUDA, one Triton kernel (``tl.rand``, the same numbers as the reference) instead of
    the reference's hundred elementwise ops; the reference where Triton is missing."""
    kernel = _triton_kernel()
    if kernel is None:
        return philox_rand_reference(seed, offset, size, dtype)
    out = torch.empty(size, dtype=torch.float32, device=seed.device)
    numel = out.numel()
    if numel:
        block = 1024
        kernel[((numel + block - 1) // block,)](out, seed.to(torch.int64), offset, numel, BLOCK=block)
    return out.to(dtype)


_kernel_cache: list = []


def _triton_kernel():
    if not _kernel_cache:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _kernel_cache.append(None)
            return None

        @triton.jit
        def philox_rand_kernel(out_ptr, seed_ptr, offset, numel, BLOCK: tl.constexpr):
            index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            seed = tl.load(seed_ptr)
            tl.store(out_ptr + index, tl.rand(seed, offset + index), mask=index < numel)

        _kernel_cache.append(philox_rand_kernel)
    return _kernel_cache[0]


_library.impl("philox_rand", philox_rand_reference, "CompositeExplicitAutograd")
_library.impl("philox_rand", _philox_rand_cuda, "CUDA")
_library._register_fake("philox_rand", _fake)

philox_rand = torch.ops.aotforge.philox_rand.default


# --- the CUDA generator's offset ------------------------------------------------------------

def cuda_offset_increment(
    numel: int, device: torch.device, *, fused_dropout: bool = False, dtype: torch.dtype = torch.float32
) -> int:
    """How far eager's CUDA random kernels (bernoulli, uniform, dropout) advance the philox
    generator's offset for ``numel`` elements: ATen's ``calc_execution_policy`` (block 256,
    4 numbers per curand4 call, the grid capped at what the device runs at once; float64
    draws unroll by 2, the fused dropout kernel always by 4)."""
    properties = torch.cuda.get_device_properties(device)
    block_size = 256
    unroll = 4 if fused_dropout or dtype != torch.float64 else 2
    blocks_per_sm = properties.max_threads_per_multi_processor // block_size
    grid = min((numel + block_size - 1) // block_size, properties.multi_processor_count * blocks_per_sm)
    grid = max(grid, 1)
    return ((numel - 1) // (block_size * grid * unroll) + 1) * 4


def mix_seed(seed: int, offset: int) -> int:
    """One 63-bit philox key per (generator seed, generator offset): successive steps advance
    the offset, so each step draws from its own key (splitmix64 finalizer)."""
    value = (seed * 0x9E3779B97F4A7C15 + offset) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (value ^ (value >> 31)) & 0x7FFFFFFFFFFFFFFF
