"""LoRA in the embedded engine on CPU: per-request adapters (what the engine does) vs an adapter merged
into a working copy of the weights, and the adapter swap vs a full-weight swap through a real gateway.

1. Decode: a batch of ``--batch`` rows, ``--tokens`` decode steps (``kv_batch.prefill`` + ``decode``,
   the engine's own forward), timed with no adapter, with every row on one per-request adapter, and
   with half the rows on it (a mixed batch). A merged adapter decodes exactly as fast as the base
   (same weights shape, no extra work), so its cost is the merge itself: ``W += scale · B A`` over every
   target layer (and the same again to unmerge or to swap to the next version), timed here.
2. Swap (``--swap``): ``tracegym serve --engine embedded``, then ``POST /api/weights/lora`` (one adapter)
   vs ``POST /api/weights/update`` (the full model) a few times each; medians of the gateway's
   ``swap_seconds`` and of the round trip, plus the bytes each writes.

    python -m benchmarks.lora_engine [--model tiny-random] [--rank 8] [--batch 16] [--tokens 32] [--swap]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tracegym.procs import free_port, start_process


def make_adapter(model_dir: Path, out: Path, rank: int) -> Path:
    """A PEFT adapter on the family's default targets with random A and B (the values do not matter)."""
    from peft import LoraConfig, get_peft_model

    from tracegym.modelfiles.load import load_model
    from tracegym.trainer.workers.lora import default_targets

    torch.manual_seed(0)
    model = load_model(model_dir, device="cpu", dtype="float32")
    targets = list(default_targets(model.config.model_type))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    peft_model.save_pretrained(out)
    return out


def decode_tok_s(model: torch.nn.Module, batch: int, tokens: int, dtype: torch.dtype | None) -> float:
    from tracegym.engine import kv_batch as kvb

    prompts = [[1, 9690, 314, 253, 100 + i, 30] for i in range(batch)]
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), ctx:
        kv, logits = kvb.prefill(model, prompts, torch.device("cpu"))
        nxt = logits.argmax(-1).tolist()
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = kvb.decode(model, kv, nxt)
            nxt = logits.argmax(-1).tolist()
        return batch * tokens / (time.perf_counter() - t0)


def merge_s(model: torch.nn.Module, adapter: object) -> float:
    """One pass of ``W += scale · B A`` over the adapter's layers (a merge; an unmerge costs the same)."""
    mods = dict(model.named_modules())
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, (at, bt) in adapter.weights.items():  # type: ignore[attr-defined]
            layer = mods[name]
            layer.weight.add_((at.float() @ bt.float()).T.to(layer.weight.dtype))
    return time.perf_counter() - t0


def bench_decode(model_dir: Path, adapter_dir: Path, batch: int, tokens: int, dtype: str, rounds: int) -> None:
    from tracegym.engine.adapters import EngineLora, read_adapter
    from tracegym.modelfiles.load import load_model

    model = load_model(model_dir, device="cpu", dtype="float32")
    ac = torch.bfloat16 if dtype == "bfloat16" else None
    lora = EngineLora(model, ac or torch.float32)  # as the engine: adapters in the compute dtype
    adapter = read_adapter("a", adapter_dir, model, lora.dtype)
    lora.add(adapter)
    rows = {"base (= merged)": [None] * batch, "per-request, all rows": [adapter] * batch,
            "per-request, half the rows": [adapter if i % 2 else None for i in range(batch)]}
    results: dict[str, list[float]] = {k: [] for k in rows}
    decode_tok_s(model, batch, 4, ac)  # warm-up
    for _ in range(rounds):  # alternate, so drift on a shared machine hits every row alike
        for name, r in rows.items():
            lora.set_rows(r)
            results[name].append(decode_tok_s(model, batch, tokens, ac))
    lora.set_rows([None] * batch)
    merges = [merge_s(model, adapter) for _ in range(rounds)]
    base = statistics.median(results["base (= merged)"])
    print(f"decode, batch {batch}, {tokens} tokens, {dtype}, median of {rounds}:")
    for name, v in results.items():
        print(f"  {name:28s} {statistics.median(v):8.1f} tok/s  ({statistics.median(v) / base:.2f}x base)")
    n = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    print(f"  merge into the weights (one pass, {len(adapter.weights)} layers, {n:,} adapter params): "
          f"{statistics.median(merges) * 1000:.1f} ms (a swap = unmerge + merge)")


def bench_swap(model_name: str, model_dir: Path, adapter_dir: Path, rounds: int, dtype: str) -> None:
    from tracegym.modelfiles.load import load_model

    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    full = tmp / "full"
    load_model(model_dir, device="cpu", dtype=dtype).save_pretrained(full)
    size = {p: sum(f.stat().st_size for f in p.rglob("*.safetensors")) for p in (full, adapter_dir)}
    port = free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", model_name, "--port", str(port),
            "--store", f"sqlite:///{tmp / 'db.sqlite'}"]
    with start_process(argv, port=port, log_path=tmp / "gw.log", health_path="/healthz", timeout=300) as gw, \
            httpx.Client(base_url=gw.base_url, timeout=300) as c:
        out: dict[str, tuple[list[float], list[float]]] = {"lora": ([], []), "full": ([], [])}
        for i in range(rounds):
            for kind in ("lora", "full"):
                v = f"{kind}{i}"
                t0 = time.perf_counter()
                if kind == "lora":
                    r = c.post("/api/weights/lora", json={"weight_version": v, "adapters": {"default": str(adapter_dir)}})
                else:
                    r = c.post("/api/weights/update", json={"weight_version": v, "model_path": str(full)})
                rt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise RuntimeError(f"{kind} swap failed: {r.text}")
                out[kind][0].append(r.json()["swap_seconds"])
                out[kind][1].append(rt)
    print(f"swap through the gateway ({model_name}, {dtype} files), median of {rounds}:")
    for kind, path in (("lora", adapter_dir), ("full", full)):
        sw, rt = out[kind]
        print(f"  {kind:5s} swap_seconds {statistics.median(sw) * 1000:7.1f} ms, round trip "
              f"{statistics.median(rt) * 1000:7.1f} ms, files {size[path] / 1e6:.2f} MB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--swap", action="store_true")
    args = ap.parse_args()
    from tracegym.modelfiles.prepare import prepare_model

    torch.set_num_threads(1)
    model_dir = prepare_model(args.model)
    adapter_dir = make_adapter(model_dir, Path(tempfile.mkdtemp(prefix="lora-adapter-")), args.rank)
    bench_decode(model_dir, adapter_dir, args.batch, args.tokens, args.dtype, args.rounds)
    if args.swap:
        bench_swap(args.model, model_dir, adapter_dir, args.rounds, args.dtype)


if __name__ == "__main__":
    main()
