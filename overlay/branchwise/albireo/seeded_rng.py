"""Counter-based, row-independent RNG: bit-exact port of SGLang's seeded sampling noise."""

import torch

M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593


def _mul32(value: torch.Tensor, const: int) -> torch.Tensor:
    # value < 2**32, const < 2**32: the int64 product wraps mod 2**64, its low 32 bits are exact.
    return (value * const) & M32


def _rotl32(value: torch.Tensor, bits: int) -> torch.Tensor:
    return ((value << bits) | (value >> (32 - bits))) & M32


def _scramble(key: torch.Tensor) -> torch.Tensor:
    return _mul32(_rotl32(_mul32(key, _C1), 15), _C2)


def _mix(state: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    state = _rotl32(state ^ _scramble(key), 13)
    return (state * 5 + 0xE6546B64) & M32


def _fmix32(state: torch.Tensor) -> torch.Tensor:
    state = _mul32(state ^ (state >> 16), 0x85EBCA6B)
    state = _mul32(state ^ (state >> 13), 0xC2B2AE35)
    return state ^ (state >> 16)


def murmur_hash32(seeds: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[n] seeds (int64 bits = SGLang's uint64), [n] positions, [m] columns -> [n, m] int64 hashes."""
    seed_bits = seeds.to(torch.int64).view(-1, 1)
    state = _mix(torch.zeros_like(seed_bits), seed_bits & M32)
    state = _mix(state, (seed_bits >> 32) & M32)
    state = _mix(state, positions.to(torch.int64).view(-1, 1) & M32)  # per-row state: [n, 1]
    state = _mix(state, cols.to(torch.int64).view(1, -1) & M32)  # key scrambled on [1, m], then broadcast
    return _fmix32(state ^ 16)  # 16 = key length in bytes


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, columns: int) -> torch.Tensor:
    """[n, columns] float64 Gumbel noise, the exact ops and clamps of SGLang's multinomial_with_seed."""
    cols = torch.arange(columns, device=seeds.device)
    uniform = murmur_hash32(seeds, positions, cols).to(torch.float64) / M32
    # Clamp both ends as SGLang does: uniform == 1 would give +inf noise, uniform == 0 -inf.
    uniform.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0**-32)).neg_()
    return uniform.log_().neg_()


def multinomial_with_seed(
    logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max draw per row from [n, m] (unnormalised) logprobs -> [n, 1] int64 column index."""
    noise = gumbel_noise(seeds, positions, logprobs.shape[1])
    return noise.add_(logprobs.to(torch.float64)).argmax(dim=1, keepdim=True)
