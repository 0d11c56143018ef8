"""One-shot device check for a lent GPU (sglang absent there): results in <out>/gpu_check.json.

(1) sampler_check: seeded RNG and row slicing give the same tokens on the device as on CPU / full batch.
(2) sampler: time of parallel_sampler.sample_rows for the full batch vs a ceil(bs/t) row slice
    (t = 2, 4, 8): the per-rank sampling cost that sequence-parallel sampling leaves.
(3) decode: forward-step latency of a random-weight Llama-8B-like decoder over a (batch, context)
    grid, eager and CUDA-graph, fitted to T = c0 + c_seq*bs + c_ctx*sum_ctx (seconds). Own
    pure-torch decoder, KV written in place. The top-level "fit" comes from this part.
(4) decode_hf: HF LlamaForCausalLM + DynamicCache on a few points only, as a cross-check.
Every part is guarded, bounded by --budget-s, and the JSON is rewritten after each measurement.
`--dry-run` runs tiny shapes on CPU in seconds; bench/gpu_check.sh is the prepared device run.
Why an own decoder, the grids and the fit: docs/design/bench-tools.md.
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
from branchwise.albireo.parallel_sampler import RowParams, sample_rows  # noqa: E402
from branchwise.albireo.seeded_rng import murmur_hash32  # noqa: E402


class Run:
    """Deadline, JSON report rewritten atomically, progress lines."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.t0, self.deadline, self.path = (
            time.monotonic(),
            time.monotonic() + budget_s,
            out / "gpu_check.json",
        )
        self.report: dict = {"errors": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def save(self) -> None:
        self.report["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(self.path)

    def part(self, name: str, fn: Callable[[], None]) -> None:
        self.log(f"== {name} ({self.left():.0f}s left)")
        try:
            fn()
        except Exception as exc:  # keep going: whatever was measured is already in the report
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            self.log(f"{name} failed: {exc!r}")
        finally:
            _free()
            self.save()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_time(fn: Callable[[], object], dev: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        start = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- sampler


def _params(mode: str, rows: int, dev: torch.device) -> RowParams:
    seeded = "unseeded" not in mode
    return RowParams.make(
        temperature=[0.0] * rows if mode == "greedy" else [0.7] * rows,
        top_p=[0.9] * rows if mode.startswith("top_p") else None,
        seed=list(range(rows)) if seeded else None,
        position=[1000 + row for row in range(rows)] if seeded else None,
        device=dev,
    )


def sampler_check(run: Run, dev: torch.device, vocab: int) -> None:
    res = run.report.setdefault("sampler_check", {})
    seeds, pos = torch.randint(0, 2**62, (32,)), torch.randint(0, 2**20, (32,))
    cols = torch.arange(vocab)
    res["murmur_device_equals_cpu"] = torch.equal(
        murmur_hash32(seeds.to(dev), pos.to(dev), cols.to(dev)).cpu(), murmur_hash32(seeds, pos, cols)
    )
    batch = 64
    logits = torch.randn(batch, vocab, device=dev) * 3
    kinds = RowParams.make(
        temperature=[0.0 if row % 5 == 0 else 0.8 for row in range(batch)],
        top_p=[0.9 if row % 2 else 1.0 for row in range(batch)],
        top_k=[40 if row % 3 == 0 else -1 for row in range(batch)],
        min_p=[0.05 if row % 7 == 0 else 0.0 for row in range(batch)],
        seed=list(range(batch)),
        position=[7 * row for row in range(batch)],
        device=dev,
    )
    full = sample_rows(logits, kinds)
    for ranks in (2, 4, 8):
        per_rank = -(-batch // ranks)
        parts = [
            sample_rows(logits[start : start + per_rank], kinds.rows(slice(start, start + per_rank)))
            for start in range(0, batch, per_rank)
        ]
        res[f"slices_t{ranks}_equal_full"] = torch.equal(torch.cat(parts), full)
    cpu = sample_rows(logits.cpu(), kinds.to("cpu"))
    res["device_vs_cpu_token_agreement"] = float((cpu == full.cpu()).float().mean())
    run.log(f"sampler_check {res}")


def sampler_timing(
    run: Run, dev: torch.device, vocab: int, batches: list[int], rank_counts: list[int], iters: int
) -> None:
    res = run.report.setdefault("sampler", {"vocab": vocab, "unit": "s", "records": []})
    for batch in batches:
        logits = torch.randn(batch, vocab, device=dev) * 3
        for mode in ("top_p_seeded", "top_p_unseeded", "temperature_seeded", "greedy"):
            params = _params(mode, batch, dev)
            full_s = None
            for ranks in rank_counts:
                if run.left() < 20:
                    run.log("sampler: budget exhausted")
                    return
                rows = -(-batch // ranks)
                slice_logits, slice_params = logits[:rows], params.rows(slice(0, rows))
                sample = partial(sample_rows, slice_logits, slice_params)
                median_s = median_time(sample, dev, warmup=3, iters=iters)
                full_s = median_s if ranks == 1 else full_s
                rec = {"mode": mode, "bs": batch, "t": ranks, "rows": rows, "median_s": median_s}
                rec["speedup_vs_full"] = full_s / median_s if full_s else None
                res["records"].append(rec)
                run.log(
                    f"sampler {mode:18s} bs={batch:4d} t={ranks} rows={rows:4d} {median_s * 1e3:8.3f} ms"
                )
            run.save()
        del logits
        _free()


# ---------------------------------------------------------------- decoder


@dataclass
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336
    vocab: int = 128256

    def kv_bytes_per_token(self, elt: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * elt


TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512)


def _rms(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h32 = hidden.float()
    return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(hidden.dtype) * weight


def _rope(vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = vec.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Decoder:
    """Llama decode step in plain torch: fused QKV / gate-up, RoPE, GQA SDPA over in-place KV, lm_head."""

    def __init__(self, shape: Shape, dev: torch.device, dtype: torch.dtype) -> None:
        def weight(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, device=dev, dtype=dtype) * 0.02

        self.shape, self.dev, self.dtype = shape, dev, dtype
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.emb, self.lm_head, self.norm = (
            weight(shape.vocab, shape.hidden),
            weight(shape.hidden, shape.vocab),
            torch.ones(shape.hidden, device=dev, dtype=dtype),
        )
        self.blocks = [
            dict(
                ln1=self.norm,
                qkv=weight(shape.hidden, q_dim + 2 * kv_dim),
                o=weight(q_dim, shape.hidden),
                ln2=self.norm,
                gu=weight(shape.hidden, 2 * shape.inter),
                down=weight(shape.inter, shape.hidden),
            )
            for _ in range(shape.layers)
        ]

    def alloc(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dims = (batch, self.shape.kv_heads, length, self.shape.head_dim)
        return [
            (
                torch.zeros(dims, device=self.dev, dtype=self.dtype),
                torch.zeros(dims, device=self.dev, dtype=self.dtype),
            )
            for _ in range(self.shape.layers)
        ]

    def step(
        self, ids: torch.Tensor, pos: int, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        shape, batch = self.shape, ids.shape[0]
        exponent = torch.arange(0, shape.head_dim, 2, device=self.dev).float() / shape.head_dim
        inv = 1.0 / (500000.0**exponent)
        cos, sin = (torch.cos(pos * inv).to(self.dtype), torch.sin(pos * inv).to(self.dtype))
        hidden = self.emb[ids]
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        group = shape.heads // shape.kv_heads
        for blk, (k_cache, v_cache) in zip(self.blocks, kv_cache, strict=True):
            query, key, value = (_rms(hidden, blk["ln1"]) @ blk["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
            query = _rope(query.view(batch, shape.heads, shape.head_dim), cos, sin)
            k_cache[:, :, pos] = _rope(key.view(batch, shape.kv_heads, shape.head_dim), cos, sin)
            v_cache[:, :, pos] = value.view(batch, shape.kv_heads, shape.head_dim)
            # GQA without copies: the `group` query heads of a KV head are its "query positions".
            attn = F.scaled_dot_product_attention(
                query.view(batch, shape.kv_heads, group, shape.head_dim), k_cache, v_cache
            )
            hidden = hidden + attn.reshape(batch, q_dim) @ blk["o"]
            gate, up = (_rms(hidden, blk["ln2"]) @ blk["gu"]).chunk(2, dim=-1)
            hidden = hidden + (F.silu(gate) * up) @ blk["down"]
        return _rms(hidden, self.norm) @ self.lm_head


def _graph_time(fn: Callable[[], object], dev: torch.device, iters: int) -> float:
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return median_time(graph.replay, dev, warmup=2, iters=iters)
    finally:
        del graph


def fit_nonneg(points: list[dict], key: str, relative: bool) -> dict | None:
    """Exact non-negative least squares for T = c0 + c_seq*bs + c_ctx*sum_ctx: the best of the
    unconstrained lstsq fits over every column subset whose coefficients are all >= 0."""
    pts = [point for point in points if point.get(key)]
    if len(pts) < 3:
        return None
    design = torch.tensor([[1.0, point["bs"], point["sum_ctx"]] for point in pts], dtype=torch.float64)
    target = torch.tensor([point[key] for point in pts], dtype=torch.float64)
    wgt = 1 / target if relative else torch.ones_like(target)
    best = None
    for mask in itertools.product((0, 1), repeat=3):
        cols = [col for col in range(3) if mask[col]]
        if not cols:
            continue
        sol = torch.linalg.lstsq(design[:, cols] * wgt[:, None], (target * wgt)[:, None]).solution.view(-1)
        if (sol < 0).any():
            continue
        coef = torch.zeros(3, dtype=torch.float64)
        coef[cols] = sol
        err = float((((design @ coef) - target) * wgt).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, coef)
    assert best is not None
    coef = best[1]
    rel = ((design @ coef) - target).abs() / target
    return {
        "c0": float(coef[0]),
        "c_seq": float(coef[1]),
        "c_ctx": float(coef[2]),
        "weighting": "relative" if relative else "absolute",
        "n_points": len(pts),
        "max_rel_err": float(rel.max()),
        "median_rel_err": float(rel.median()),
    }


def _grid(batches: list[int], ctxs: list[int], max_kv_tokens: int) -> list[tuple[int, int]]:
    return [(batch, ctx) for batch in batches for ctx in ctxs if batch * ctx <= max_kv_tokens]


def decode_grid(
    run: Run, dev: torch.device, dtype: torch.dtype, shape: Shape, grid: list[tuple[int, int]], iters: int
) -> None:
    res = run.report.setdefault(
        "decode", {"model": asdict(shape), "dtype": str(dtype), "unit": "s", "points": []}
    )
    res["note"] = "sum_ctx = bs * (ctx + 1): keys attended per step; KV preallocated and written in place"
    model = Decoder(shape, dev, dtype)
    layer_params = sum(tensor.numel() for block in model.blocks for tensor in block.values())
    run.log(f"decoder built: {layer_params / 1e9:.2f}B layer params")
    use_graph, graph_failures = dev.type == "cuda", 0
    for batch, ctx in grid:
        if run.left() < 25:
            run.log("decode: budget exhausted")
            break
        point = {
            "bs": batch,
            "ctx": ctx,
            "sum_ctx": batch * (ctx + 1),
            "kv_gb": batch * (ctx + 1) * shape.kv_bytes_per_token() / 1e9,
        }
        try:
            kv_cache = model.alloc(batch, ctx + 1)
            ids = torch.randint(0, shape.vocab, (batch,), device=dev)
            step = partial(model.step, ids, ctx, kv_cache)
            with torch.inference_mode():
                point["eager_s"] = median_time(step, dev, warmup=2, iters=iters)
                if use_graph:
                    try:
                        point["graph_s"] = _graph_time(step, dev, iters=2 * iters)
                    except Exception as exc:  # capture unsupported here: stop trying after 3 failures
                        point["graph_error"] = repr(exc)[:300]
                        graph_failures += 1
                        use_graph = graph_failures < 3
        except Exception as exc:  # OOM or a kernel gap: record, try the next point
            point["error"] = repr(exc)[:300]
        finally:
            kv_cache = step = None
            _free()
        res["points"].append(point)
        run.log(
            f"decode bs={batch:4d} ctx={ctx:5d} eager={point.get('eager_s', 0) * 1e3:8.2f} ms"
            f" graph={point.get('graph_s', 0) * 1e3:8.2f} ms"
        )
        run.save()
    model = None
    for key in ("graph_s", "eager_s"):
        for relative in (True, False):
            fit = fit_nonneg(res["points"], key, relative)
            if fit:
                res[f"fit_{key[:-2]}_{'rel' if relative else 'abs'}"] = fit
    best = res.get("fit_graph_rel") or res.get("fit_eager_rel")
    if best:
        run.report["fit"] = {coef: best[coef] for coef in ("c0", "c_seq", "c_ctx")} | {
            "source": "graph" if "fit_graph_rel" in res else "eager"
        }
        run.log(f"fit {run.report['fit']}")


def decode_hf(
    run: Run, dev: torch.device, dtype: torch.dtype, shape: Shape, grid: list[tuple[int, int]], iters: int
) -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    res = run.report.setdefault("decode_hf", {"unit": "s", "points": []})
    cfg = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.inter, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, max_position_embeddings=16384, rope_theta=500000.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    res["transformers_version"] = __import__("transformers").__version__
    for batch, ctx in grid:
        if run.left() < 25:
            break
        cache = DynamicCache()
        zeros = torch.zeros(batch, shape.kv_heads, ctx, shape.head_dim, device=dev, dtype=dtype)
        for layer in range(shape.layers):
            cache.update(zeros.clone(), zeros.clone(), layer)
        del zeros
        ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        pos = torch.full((batch, 1), ctx, device=dev)
        with torch.inference_mode():
            step = partial(model, input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            step_s = median_time(step, dev, 1, iters)
        res["points"].append({"bs": batch, "ctx": ctx, "sum_ctx": batch * (ctx + 1), "eager_s": step_s})
        run.log(f"decode_hf bs={batch:4d} ctx={ctx:5d} {step_s * 1e3:8.2f} ms (cache grows by 1 per call)")
        cache = step = None
        _free()
        run.save()
    res["fit_eager_rel"] = fit_nonneg(res["points"], "eager_s", relative=True)


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    parser.add_argument(
        "--dry-run", action="store_true", help="= --device cpu --tiny: exercises the logic in seconds"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget-s", type=float, default=360)
    parser.add_argument("--parts", default="sampler_check,sampler,decode,decode_hf")
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    dev = torch.device(args.device)
    run = Run(Path(args.out), args.budget_s)
    parts = set(args.parts.split(","))
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
        "tiny": args.tiny,
        "argv": sys.argv,
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env |= {"gpu": props.name, "gpu_mem_gb": props.total_memory / 1e9}
    run.report["env"] = env
    run.log(f"env {env}")
    if args.tiny:
        vocab, batches, rank_counts, iters = 4096, [8, 16], [1, 2, 4], 2
        shape, dtype = TINY, torch.float32
        grid = _grid([1, 4, 8], [16, 64], 10**9)
        hf_grid = [(1, 16), (4, 16), (4, 64)]
    else:
        vocab, batches, rank_counts, iters = 152064, [32, 64, 128, 256, 512], [1, 2, 4, 8], 10
        shape, dtype = Shape(), torch.bfloat16
        # KV capped at 2**18 tokens (~34 GB for this shape) next to 16 GB of weights.
        grid = _grid(
            [1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512], [64, 256, 512, 1024, 2048, 4096, 8192], 2**18
        )
        hf_grid = [(1, 512), (1, 2048), (16, 1024), (64, 512), (64, 1024)]
    steps = [
        ("sampler_check", lambda: sampler_check(run, dev, vocab)),
        ("sampler", lambda: sampler_timing(run, dev, vocab, batches, rank_counts, iters)),
        ("decode", lambda: decode_grid(run, dev, dtype, shape, grid, max(3, iters // 2))),
        ("decode_hf", lambda: decode_hf(run, dev, dtype, shape, hf_grid, 3)),
    ]
    for name, fn in steps:
        if name in parts and run.left() > 20:
            run.part(name, fn)
    run.log(f"done: {run.path} errors={list(run.report['errors'])}")
    return 1 if run.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
