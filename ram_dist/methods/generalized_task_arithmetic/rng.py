"""Counter-based uniform random numbers, one per flat element of a tensor.

DARE drops each element of a task vector at random. A chunked, multi-worker engine cannot
share a sequential generator (torch's global one, as mergekit uses): the draw of element i
would depend on which chunk drew first. Here a draw is a pure function of
(seed, task index, tensor name, flat element index), so any chunking, worker count, chunk
order or device gives the same mask.

The stream key folds seed, task and a SHA-256 of the UTF-8 tensor name (never Python's
salted `hash()`) through the splitmix64 finalizer on Python integers. Element i then draws
`splitmix64_mix(key + i * GOLDEN)`, the splitmix64 sequence itself, which passes BigCrush
for one stream. The mix is done with torch int64 tensor ops: multiplication and addition
wrap modulo 2**64 on CPU and CUDA alike, and right shifts of signed int64 are arithmetic, so
every shift is masked afterwards to make it logical. The top 24 bits give a float32 in
[0, 1) exactly (`bits / 2**24`), the full resolution of a float32 in that range.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB

#: Number of random bits behind each uniform value.
BITS = 24


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value` (torch scalars are signed)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(z: int) -> int:
    """splitmix64's finalizer on unsigned 64-bit Python integers (the reference for tests)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def name_hash(tensor_name: str) -> int:
    """A stable 64-bit hash of a tensor name: the same in every process and on every host."""
    return int.from_bytes(hashlib.sha256(tensor_name.encode("utf-8")).digest()[:8], "little")


def stream_key(seed: int, task: int, tensor_name: str) -> int:
    """The unsigned 64-bit key of one (seed, task, tensor) stream."""
    key = mix64(seed + _GOLDEN)
    key = mix64((key ^ (task & _MASK64)) + _GOLDEN)
    return mix64((key ^ name_hash(tensor_name)) + _GOLDEN)


def _xor_shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """`z ^= z >>> s` in place, with a logical shift (torch's `>>` on int64 is arithmetic)."""
    shifted = z >> s
    shifted &= (1 << (64 - s)) - 1
    return z.bitwise_xor_(shifted)


def random_bits(
    seed: int,
    task: int,
    tensor_name: str,
    start: int,
    stop: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int64 in [0, 2**24): the top 24 bits of element i's draw, for i in [start, stop)."""
    import torch

    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    z = torch.arange(start, stop, dtype=torch.int64, device=device)
    z.mul_(_signed(_GOLDEN)).add_(_signed(stream_key(seed, task, tensor_name)))
    _xor_shift_right(z, 30).mul_(_signed(_MUL1))
    _xor_shift_right(z, 27).mul_(_signed(_MUL2))
    _xor_shift_right(z, 31)
    z >>= 64 - BITS
    return z.bitwise_and_((1 << BITS) - 1)


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from `random_bits`: `bits / 2**24`, exact."""
    import torch

    return bits.to(torch.float32).mul_(2.0**-BITS)
