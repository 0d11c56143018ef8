"""Sequence-parallel sampler core: bit-exact seeded RNG, SGLang-equal sampling, row independence."""

import ast
import importlib.util
import math
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from branchwise.albireo.parallel_sampler import (
    TOP_K_ALL,
    RowParams,
    sample_rows,
    sp_sample,
    sp_sample_full,
)
from branchwise.albireo.seeded_rng import M32, murmur_hash32

# ---------------------------------------------------------------- pure-python MurmurHash3_x86_32


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _fmix(h: int) -> int:
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """The textbook algorithm over bytes (blocks, tail, length, fmix)."""
    c1, c2, h, n4 = 0xCC9E2D51, 0x1B873593, seed, len(data) // 4 * 4
    for i in range(0, n4, 4):
        k = _rotl((int.from_bytes(data[i : i + 4], "little") * c1) & M32, 15) * c2 & M32
        h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    tail = data[n4:]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= _rotl((k * c1) & M32, 15) * c2 & M32
    return _fmix(h ^ len(data))


def ref_hash(seed: int, pos: int, col: int) -> int:
    """SGLang's key layout: uint64 seed (lo, hi), uint32 position, uint32 column; hash seed 0."""
    return murmur3_x86_32(struct.pack("<QII", seed & (2**64 - 1), pos & M32, col & M32))


@pytest.mark.parametrize(
    "data,seed,want",
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
        (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ],
)
def test_python_reference_matches_known_vectors(data: bytes, seed: int, want: int) -> None:
    assert murmur3_x86_32(data, seed) == want


def test_murmur_matches_python_reference() -> None:
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat(
        [torch.tensor([0, 42, -1, 2**40 + 7, -(2**63)]), torch.randint(-(2**62), 2**62, (5,), generator=g)]
    )
    positions = torch.cat(
        [torch.tensor([0, 1, 2**31, 2**32 + 5, 123456]), torch.randint(0, 2**20, (5,), generator=g)]
    )
    cols = torch.cat([torch.arange(6), torch.tensor([151935, 2**31 - 1])])
    got = murmur_hash32(seeds, positions, cols)
    assert got.dtype == torch.int64 and int(got.min()) >= 0 and int(got.max()) <= M32
    for i in range(len(seeds)):
        for j in range(len(cols)):
            assert int(got[i, j]) == ref_hash(int(seeds[i]), int(positions[i]), int(cols[j]))


# ---------------------------------------------------------------- SGLang's own code, read as source


def _sglang_file(rel: str) -> Path:
    spec = importlib.util.find_spec("sglang")  # locates without importing the heavy package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang source not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.exists():
        pytest.skip(f"{rel} not in this sglang")
    return path


def _load_defs(rel: str, names: set[str], namespace: dict) -> dict:
    """Exec selected top-level defs/assignments of an SGLang file, decorators stripped."""
    tree = ast.parse(_sglang_file(rel).read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets):
            keep.append(node)
    assert {getattr(n, "name", None) or n.targets[0].id for n in keep} == names
    exec(compile(ast.Module(body=keep, type_ignores=[]), rel, "exec"), namespace)
    return namespace


def test_murmur_matches_sglang_torch_and_python_ports() -> None:
    # watermarking/core.py hashes (key_lo, key_hi, context, token) exactly like murmur_hash32's
    # (seed_lo, seed_hi, position, column), in int64 torch ops.
    wm = _load_defs(
        "srt/sampling/watermarking/core.py",
        {"_MASK32", "_rotl32", "_murmur3_mix", "_fmix32", "_watermark_hash32_torch"},
        {"torch": torch},
    )
    seeds = torch.tensor([0, 1, 42, 2**33 + 3, 987654321])
    positions = torch.tensor([0, 7, 100, 4096, 2**31 + 1])
    cols = torch.arange(1000)
    want = wm["_watermark_hash32_torch"](seeds, positions, cols)
    assert torch.equal(murmur_hash32(seeds, positions, cols), want)
    # The MLX backend's python-int block mix (the per-row part of the same kernel).
    mix = _load_defs("srt/hardware_backend/mlx/sampling.py", {"_murmur3_mix_py"}, {})["_murmur3_mix_py"]
    for s, pos in zip(seeds.tolist(), positions.tolist(), strict=True):
        h = mix(mix(mix(0, s & M32), s >> 32), pos & M32)
        assert _fmix(mix(h, 5) ^ 16) == int(
            murmur_hash32(torch.tensor([s]), torch.tensor([pos]), torch.tensor([5]))
        )


def _sglang_sampling_fns() -> dict:
    from branchwise.albireo.seeded_rng import murmur_hash32 as ours

    ns = {"torch": torch, "Optional": Optional, "TOP_K_ALL": TOP_K_ALL, "murmur_hash32": ours}
    names = {
        "multinomial_with_seed",
        "sampling_from_probs_torch",
        "top_k_top_p_min_p_sampling_from_probs_torch",
    }
    return _load_defs("srt/layers/sampler.py", names, ns)


def _sglang_sample(fns: dict, logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Sampler.forward's standard (deterministic-inference) path, seeds set."""
    if p.all_greedy:
        return torch.argmax(logits, -1)
    logits = logits.clone().div_(p.temperatures.view(-1, 1))
    probs = torch.softmax(logits, dim=-1)
    if not (p.need_top_k or p.need_top_p or p.need_min_p):
        return fns["sampling_from_probs_torch"](probs, p.seeds, p.positions)
    return fns["top_k_top_p_min_p_sampling_from_probs_torch"](
        probs, p.top_ks, p.top_ps, p.min_ps, p.need_min_p, p.seeds, p.positions
    )


# ---------------------------------------------------------------- batches


def _batch(n: int, seed: int = 0, kinds: str = "gtkpm") -> RowParams:
    """Mixed rows cycling through kinds: g greedy, t temperature, k top-k, p top-p, m min-p."""
    rows = [kinds[i % len(kinds)] for i in range(n)]
    return RowParams.make(
        temperature=[0.0 if r == "g" else 0.5 + 0.1 * (i % 7) for i, r in enumerate(rows)],
        top_p=[0.8 if r == "p" else 1.0 for r in rows],
        top_k=[3 + i % 5 if r == "k" else -1 for i, r in enumerate(rows)],
        min_p=[0.05 if r == "m" else 0.0 for r in rows],
        seed=[1000 * seed + i for i in range(n)],
        position=[17 + 3 * i for i in range(n)],
    )


def _logits(n: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("kinds", ["g", "t", "tk", "tp", "gtkp"])
def test_matches_sglang_sampler_source(kinds: str) -> None:
    fns = _sglang_sampling_fns()
    for trial in range(3):
        logits, p = _logits(24, 300, trial), _batch(24, trial, kinds)
        want = _sglang_sample(fns, logits, p)
        got = sample_rows(logits, p)
        assert got.dtype == want.dtype and torch.equal(got, want)


def _reference(logits: torch.Tensor, p: RowParams) -> list[int]:
    """Row by row in python: filters on sorted probs, Gumbel noise from the python hash."""
    filtered = p.need_top_k or p.need_top_p or p.need_min_p
    out = []
    for i in range(p.n):
        if p.all_greedy:
            out.append(int(logits[i].argmax()))
            continue
        probs = torch.softmax(logits[i] / p.temperatures[i], -1).tolist()
        order = sorted(range(len(probs)), key=lambda j: (-probs[j], j)) if filtered else range(len(probs))
        kept, cum = [], 0.0
        for rank, j in enumerate(order):
            ok = not filtered or (rank < int(p.top_ks[i]) and cum <= float(p.top_ps[i]))
            kept.append(probs[j] if ok else 0.0)
            cum += probs[j]
        if filtered and p.need_min_p:
            kept = [q if q >= kept[0] * float(p.min_ps[i]) else 0.0 for q in kept]
        seed, pos = int(p.seeds[i]), int(p.positions[i])
        best, best_val = -1, -math.inf
        for c, q in enumerate(kept):
            if q <= 0:
                continue
            u = min(max(ref_hash(seed, pos, c) / M32, 1e-300), 1 - 1e-16)
            val = math.log(q) - math.log(-math.log(u))
            if val > best_val:
                best, best_val = c, val
        out.append(order[best] if filtered else best)
    return out


@pytest.mark.parametrize("kinds", ["g", "t", "gtkpm", "m"])
def test_matches_straightforward_reference(kinds: str) -> None:
    logits, p = _logits(12, 64, 5), _batch(12, 5, kinds)
    assert sample_rows(logits, p).tolist() == _reference(logits, p)


def test_row_placement_independent() -> None:
    n, v = 30, 500
    logits, p = _logits(n, v, 1), _batch(n, 1)
    full = sample_rows(logits, p)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample_rows(logits[perm], p.rows(perm)), full[perm])
    for t in (2, 3, 4, 7):
        r = -(-n // t)
        parts = [sample_rows(logits[i : i + r], p.rows(slice(i, i + r))) for i in range(0, n, r)]
        assert torch.equal(torch.cat(parts), full)


def test_greedy_equals_argmax_and_top_k_one() -> None:
    logits = _logits(16, 200, 2)
    logits[3, [5, 50, 150]] = 50.0  # a tie: stable sort and argmax both pick the lowest id
    greedy = RowParams.make([0.0] * 16)
    assert greedy.all_greedy and torch.equal(sample_rows(logits, greedy), logits.argmax(-1))
    assert int(sample_rows(logits, greedy)[3]) == 5
    # Greedy rows inside a sampled batch go through top_k = 1 (SGLang's normalisation).
    mixed = _batch(16, 2)
    ids = sample_rows(logits, mixed)
    is_greedy = mixed.top_ks == 1
    assert torch.equal(ids[is_greedy].long(), logits.argmax(-1)[is_greedy])
    top1 = RowParams.make([0.9] * 16, top_k=[1] * 16, seed=list(range(16)), position=[0] * 16)
    assert torch.equal(sample_rows(logits, top1).long(), logits.argmax(-1))


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    # One row repeated at 4000 positions: frequencies ~ renormalised top-p probs, excluded ids never.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    p = RowParams.make([1.0] * n, top_p=[0.85] * n, seed=[7] * n, position=list(range(n)))
    freq = torch.bincount(sample_rows(logits, p).long(), minlength=5).float() / n
    want = torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9
    assert (freq - want).abs().max() < 0.03 and freq[3:].sum() == 0


def test_unseeded_paths_stay_in_support() -> None:
    logits = _logits(40, 100, 4)
    p = RowParams.make([0.8] * 40, top_k=[4] * 40)
    ids = sample_rows(logits, p).long()
    top4 = logits.topk(4, -1).indices
    assert (top4 == ids[:, None]).any(-1).all()
    plain = sample_rows(logits, RowParams.make([1.0] * 40))
    assert plain.dtype == torch.int32 and int(plain.min()) >= 0 and int(plain.max()) < 100


def test_params_padding_rows_and_from_sampling_info() -> None:
    p = _batch(5)
    q = p.padded(8)
    assert q.n == 8 and q.top_ks[5:].tolist() == [1, 1, 1] and q.seeds is not None
    assert (q.need_top_p, q.all_greedy) == (p.need_top_p, p.all_greedy)  # switches of the real batch
    assert q.rows(slice(0, 5)).top_ps.tolist() == p.top_ps.tolist()
    info = SimpleNamespace(
        temperatures=p.temperatures.view(-1, 1),
        top_ps=p.top_ps,
        top_ks=p.top_ks,
        min_ps=p.min_ps,
        sampling_seed=p.seeds,
        is_all_greedy=p.all_greedy,
        need_top_k_sampling=p.need_top_k,
        need_top_p_sampling=p.need_top_p,
        need_min_p_sampling=p.need_min_p,
    )
    r = RowParams.from_sampling_info(info, p.positions)
    logits = _logits(5, 40)
    assert torch.equal(sample_rows(logits, r), sample_rows(logits, p))


def test_single_process_sp_sample_trims_vocab_padding() -> None:
    logits, p = _logits(6, 103, 9), _batch(6, 9)
    padded = torch.cat([logits, torch.full((6, 9), 1e4)], dim=1)  # lm_head padding columns
    want = sample_rows(logits, p)
    assert torch.equal(sp_sample(padded, p, vocab_size=103), want)
    assert torch.equal(sp_sample_full(logits, p), want)
    assert sample_rows(logits, p) is not logits and torch.equal(logits, _logits(6, 103, 9))  # input untouched
