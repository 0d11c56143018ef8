"""One-shot device check for a lent GPU (sglang absent there): results in <out>/gpu_check.json.

(1) sampler_check: seeded RNG and row slicing give the same tokens on the device as on CPU / full batch.
(2) sampler: time of parallel_sampler.sample_rows for the full batch vs a ceil(bs/t) row slice
    (t = 2, 4, 8): the per-rank sampling cost that sequence-parallel sampling leaves.
(3) decode: forward-step latency of a random-weight Llama-8B-like decoder over a (batch, context)
    grid, eager and CUDA-graph, fitted to T = c0 + c_seq*bs + c_ctx*sum_ctx (seconds).
    Own pure-torch decoder, KV written in place into preallocated buffers as a paged engine does:
    HF's DynamicCache concatenates the whole cache every step (~3x the KV traffic), which would
    inflate c_ctx. The top-level "fit" comes from this part (graph times when capture works).
(4) decode_hf: HF LlamaForCausalLM + DynamicCache on a few points only, as a cross-check.
Every part is guarded, bounded by --budget-s, and the JSON is rewritten after each measurement.
`--dry-run` runs tiny shapes on CPU in seconds.
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
        except Exception as e:  # keep going: whatever was measured is already in the report
            self.report["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
            self.log(f"{name} failed: {e!r}")
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
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------- sampler


def _params(mode: str, n: int, dev: torch.device) -> RowParams:
    seeded = "unseeded" not in mode
    return RowParams.make(
        temperature=[0.0] * n if mode == "greedy" else [0.7] * n,
        top_p=[0.9] * n if mode.startswith("top_p") else None,
        seed=list(range(n)) if seeded else None,
        position=[1000 + i for i in range(n)] if seeded else None,
        device=dev,
    )


def sampler_check(run: Run, dev: torch.device, vocab: int) -> None:
    res = run.report.setdefault("sampler_check", {})
    seeds, pos = torch.randint(0, 2**62, (32,)), torch.randint(0, 2**20, (32,))
    cols = torch.arange(vocab)
    res["murmur_device_equals_cpu"] = torch.equal(
        murmur_hash32(seeds.to(dev), pos.to(dev), cols.to(dev)).cpu(), murmur_hash32(seeds, pos, cols)
    )
    bs = 64
    logits = torch.randn(bs, vocab, device=dev) * 3
    kinds = RowParams.make(
        temperature=[0.0 if i % 5 == 0 else 0.8 for i in range(bs)],
        top_p=[0.9 if i % 2 else 1.0 for i in range(bs)],
        top_k=[40 if i % 3 == 0 else -1 for i in range(bs)],
        min_p=[0.05 if i % 7 == 0 else 0.0 for i in range(bs)],
        seed=list(range(bs)),
        position=[7 * i for i in range(bs)],
        device=dev,
    )
    full = sample_rows(logits, kinds)
    for t in (2, 4, 8):
        r = -(-bs // t)
        parts = [sample_rows(logits[i : i + r], kinds.rows(slice(i, i + r))) for i in range(0, bs, r)]
        res[f"slices_t{t}_equal_full"] = torch.equal(torch.cat(parts), full)
    cpu = sample_rows(logits.cpu(), kinds.to("cpu"))
    res["device_vs_cpu_token_agreement"] = float((cpu == full.cpu()).float().mean())
    run.log(f"sampler_check {res}")


def sampler_timing(
    run: Run, dev: torch.device, vocab: int, batches: list[int], ts: list[int], iters: int
) -> None:
    res = run.report.setdefault("sampler", {"vocab": vocab, "unit": "s", "records": []})
    for bs in batches:
        logits = torch.randn(bs, vocab, device=dev) * 3
        for mode in ("top_p_seeded", "top_p_unseeded", "temperature_seeded", "greedy"):
            p = _params(mode, bs, dev)
            full_s = None
            for t in ts:
                if run.left() < 20:
                    run.log("sampler: budget exhausted")
                    return
                r = -(-bs // t)
                x, q = logits[:r], p.rows(slice(0, r))
                s = median_time(lambda x=x, q=q: sample_rows(x, q), dev, warmup=3, iters=iters)
                full_s = s if t == 1 else full_s
                rec = {"mode": mode, "bs": bs, "t": t, "rows": r, "median_s": s}
                rec["speedup_vs_full"] = full_s / s if full_s else None
                res["records"].append(rec)
                run.log(f"sampler {mode:18s} bs={bs:4d} t={t} rows={r:4d} {s * 1e3:8.3f} ms")
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


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Decoder:
    """Llama decode step in plain torch: fused QKV / gate-up, RoPE, GQA SDPA over in-place KV, lm_head."""

    def __init__(self, s: Shape, dev: torch.device, dtype: torch.dtype) -> None:
        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=dev, dtype=dtype) * 0.02

        self.s, self.dev, self.dtype = s, dev, dtype
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.emb, self.lm_head, self.norm = (
            w(s.vocab, s.hidden),
            w(s.hidden, s.vocab),
            torch.ones(s.hidden, device=dev, dtype=dtype),
        )
        self.blocks = [
            dict(
                ln1=self.norm,
                qkv=w(s.hidden, q + 2 * kv),
                o=w(q, s.hidden),
                ln2=self.norm,
                gu=w(s.hidden, 2 * s.inter),
                down=w(s.inter, s.hidden),
            )
            for _ in range(s.layers)
        ]

    def alloc(self, bs: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (bs, self.s.kv_heads, length, self.s.head_dim)
        return [
            (
                torch.zeros(shape, device=self.dev, dtype=self.dtype),
                torch.zeros(shape, device=self.dev, dtype=self.dtype),
            )
            for _ in range(self.s.layers)
        ]

    def step(self, ids: torch.Tensor, pos: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        s, bs = self.s, ids.shape[0]
        inv = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=self.dev).float() / s.head_dim))
        cos, sin = (torch.cos(pos * inv).to(self.dtype), torch.sin(pos * inv).to(self.dtype))
        h = self.emb[ids]
        q_dim, kv_dim, group = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.heads // s.kv_heads
        for blk, (k_cache, v_cache) in zip(self.blocks, kv, strict=True):
            q, k, v = (_rms(h, blk["ln1"]) @ blk["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = _rope(q.view(bs, s.heads, s.head_dim), cos, sin)
            k_cache[:, :, pos] = _rope(k.view(bs, s.kv_heads, s.head_dim), cos, sin)
            v_cache[:, :, pos] = v.view(bs, s.kv_heads, s.head_dim)
            # GQA without copies: the `group` query heads of a KV head are its "query positions".
            o = F.scaled_dot_product_attention(q.view(bs, s.kv_heads, group, s.head_dim), k_cache, v_cache)
            h = h + o.reshape(bs, q_dim) @ blk["o"]
            gate, up = (_rms(h, blk["ln2"]) @ blk["gu"]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ blk["down"]
        return _rms(h, self.norm) @ self.lm_head


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
    pts = [p for p in points if p.get(key)]
    if len(pts) < 3:
        return None
    x = torch.tensor([[1.0, p["bs"], p["sum_ctx"]] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[key] for p in pts], dtype=torch.float64)
    wgt = 1 / y if relative else torch.ones_like(y)
    best = None
    for mask in itertools.product((0, 1), repeat=3):
        cols = [i for i in range(3) if mask[i]]
        if not cols:
            continue
        sol = torch.linalg.lstsq(x[:, cols] * wgt[:, None], (y * wgt)[:, None]).solution.view(-1)
        if (sol < 0).any():
            continue
        coef = torch.zeros(3, dtype=torch.float64)
        coef[cols] = sol
        err = float((((x @ coef) - y) * wgt).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, coef)
    assert best is not None
    coef = best[1]
    rel = ((x @ coef) - y).abs() / y
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
    return [(bs, c) for bs in batches for c in ctxs if bs * c <= max_kv_tokens]


def decode_grid(
    run: Run, dev: torch.device, dtype: torch.dtype, s: Shape, grid: list[tuple[int, int]], iters: int
) -> None:
    res = run.report.setdefault(
        "decode", {"model": asdict(s), "dtype": str(dtype), "unit": "s", "points": []}
    )
    res["note"] = "sum_ctx = bs * (ctx + 1): keys attended per step; KV preallocated and written in place"
    model = Decoder(s, dev, dtype)
    run.log(
        f"decoder built: {sum(t.numel() for b in model.blocks for t in b.values()) / 1e9:.2f}B layer params"
    )
    use_graph, graph_failures = dev.type == "cuda", 0
    for bs, ctx in grid:
        if run.left() < 25:
            run.log("decode: budget exhausted")
            break
        point = {
            "bs": bs,
            "ctx": ctx,
            "sum_ctx": bs * (ctx + 1),
            "kv_gb": bs * (ctx + 1) * s.kv_bytes_per_token() / 1e9,
        }
        try:
            kv = model.alloc(bs, ctx + 1)
            ids = torch.randint(0, s.vocab, (bs,), device=dev)
            step = partial(model.step, ids, ctx, kv)
            with torch.inference_mode():
                point["eager_s"] = median_time(step, dev, warmup=2, iters=iters)
                if use_graph:
                    try:
                        point["graph_s"] = _graph_time(step, dev, iters=2 * iters)
                    except Exception as e:  # capture unsupported here: stop trying after 3 failures
                        point["graph_error"] = repr(e)[:300]
                        graph_failures += 1
                        use_graph = graph_failures < 3
        except Exception as e:  # OOM or a kernel gap: record, try the next point
            point["error"] = repr(e)[:300]
        finally:
            kv = step = None
            _free()
        res["points"].append(point)
        run.log(
            f"decode bs={bs:4d} ctx={ctx:5d} eager={point.get('eager_s', 0) * 1e3:8.2f} ms graph={point.get('graph_s', 0) * 1e3:8.2f} ms"
        )
        run.save()
    model = None
    for key in ("graph_s", "eager_s"):
        for relative in (True, False):
            f = fit_nonneg(res["points"], key, relative)
            if f:
                res[f"fit_{key[:-2]}_{'rel' if relative else 'abs'}"] = f
    best = res.get("fit_graph_rel") or res.get("fit_eager_rel")
    if best:
        run.report["fit"] = {k: best[k] for k in ("c0", "c_seq", "c_ctx")} | {
            "source": "graph" if "fit_graph_rel" in res else "eager"
        }
        run.log(f"fit {run.report['fit']}")


def decode_hf(
    run: Run, dev: torch.device, dtype: torch.dtype, s: Shape, grid: list[tuple[int, int]], iters: int
) -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    res = run.report.setdefault("decode_hf", {"unit": "s", "points": []})
    cfg = LlamaConfig(
        hidden_size=s.hidden, intermediate_size=s.inter, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, max_position_embeddings=16384,
        rope_theta=500000.0,
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
    for bs, ctx in grid:
        if run.left() < 25:
            break
        cache = DynamicCache()
        zeros = torch.zeros(bs, s.kv_heads, ctx, s.head_dim, device=dev, dtype=dtype)
        for layer in range(s.layers):
            cache.update(zeros.clone(), zeros.clone(), layer)
        del zeros
        ids, pos = torch.zeros(bs, 1, dtype=torch.long, device=dev), torch.full((bs, 1), ctx, device=dev)
        with torch.inference_mode():
            step = partial(model, input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            t = median_time(step, dev, 1, iters)
        res["points"].append({"bs": bs, "ctx": ctx, "sum_ctx": bs * (ctx + 1), "eager_s": t})
        run.log(f"decode_hf bs={bs:4d} ctx={ctx:5d} {t * 1e3:8.2f} ms (cache grows by 1 per call)")
        cache = step = None
        _free()
        run.save()
    res["fit_eager_rel"] = fit_nonneg(res["points"], "eager_s", relative=True)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument(
        "--dry-run", action="store_true", help="= --device cpu --tiny: exercises the logic in seconds"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=360)
    ap.add_argument("--parts", default="sampler_check,sampler,decode,decode_hf")
    args = ap.parse_args()
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
        vocab, batches, ts, iters = 4096, [8, 16], [1, 2, 4], 2
        shape, dtype = TINY, torch.float32
        grid = _grid([1, 4, 8], [16, 64], 10**9)
        hf_grid = [(1, 16), (4, 16), (4, 64)]
    else:
        vocab, batches, ts, iters = 152064, [32, 64, 128, 256, 512], [1, 2, 4, 8], 10
        shape, dtype = Shape(), torch.bfloat16
        # KV capped at 2**18 tokens (~34 GB for this shape) next to 16 GB of weights.
        grid = _grid(
            [1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512], [64, 256, 512, 1024, 2048, 4096, 8192], 2**18
        )
        hf_grid = [(1, 512), (1, 2048), (16, 1024), (64, 512), (64, 1024)]
    steps = [
        ("sampler_check", lambda: sampler_check(run, dev, vocab)),
        ("sampler", lambda: sampler_timing(run, dev, vocab, batches, ts, iters)),
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
