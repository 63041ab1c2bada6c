"""Loading a prepared model with torch: the device, the dtype (and whether this CPU computes bf16 fast
enough to use it), and the transformers model itself."""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | None, device: str) -> Any:
    """``float32``/``bfloat16``/``float16`` (or ``None``: bf16 on CUDA, fp32 on CPU) as a torch dtype."""
    import torch

    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(table)}")
    return table[dtype]


def cpu_compute_dtype(dtype: Any) -> Any:
    """``dtype`` for compute on this machine's CPU: bf16 becomes fp32 where bf16 runs a transformer slower
    than fp32 (``cpu_bf16_is_fast``: CPUs without AMX, where a bf16 matmul can be many times slower).
    Results stay correct in fp32, only bf16's memory saving is lost."""
    import torch

    if dtype is torch.bfloat16 and not cpu_bf16_is_fast():
        if os.environ.get(CPU_BF16_ENV) == "slow":
            log.info("computing in float32: $%s=slow (bfloat16 is slower on this CPU)", CPU_BF16_ENV)
        else:
            log.warning("this CPU runs bfloat16 slower than float32 (bf16/fp32 time %.2f on a small Llama): "
                        "computing in float32", bf16_slowdown())
        return torch.float32
    return dtype


CPU_BF16_ENV = "TRACEGYM_CPU_BF16"
"""``fast`` or ``slow``: decides ``cpu_bf16_is_fast`` without timing. ``tracegym train`` times once and sets it
for the processes it starts, so its engines and trainer workers compute in one dtype: each process timing
on its own can land on either side when bf16 and fp32 run about as fast."""


def decide_cpu_bf16() -> None:
    """``cpu_bf16_is_fast`` once for this process and the ones it starts (sets ``$TRACEGYM_CPU_BF16``, unless
    it is set already); nothing on a machine with CUDA, whose processes compute on the GPU."""
    import torch

    if not torch.cuda.is_available():
        os.environ[CPU_BF16_ENV] = "fast" if cpu_bf16_is_fast() else "slow"


def cpu_bf16_is_fast() -> bool:
    """Whether bf16 runs a transformer at least as fast as fp32 on this CPU: never without oneDNN's bf16
    kernels (they need AVX-512; torch's fallback is tens of times slower), else timed (``bf16_slowdown``);
    ``$TRACEGYM_CPU_BF16`` set to ``fast``/``slow`` decides instead."""
    import torch

    forced = os.environ.get(CPU_BF16_ENV)
    if forced:
        if forced not in ("fast", "slow"):
            raise ValueError(f"${CPU_BF16_ENV} must be 'fast' or 'slow', got {forced!r}")
        return forced == "fast"
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        pass
    return bf16_slowdown() <= 1.0


BF16_PROBE_ROUNDS = 5
"""Rounds of ``bf16_slowdown``, each timing both dtypes; the fastest of each dtype's rounds is compared. On
a CPU where the two are close (AVX512-BF16 without AMX) one round each, the one after the other, put bf16
on either side of fp32 from one process to the next."""


@functools.lru_cache(maxsize=1)
def bf16_slowdown() -> float:
    """bf16 time / fp32 time of forwards through a small random Llama (SmolLM2's widths, 2 layers) at the
    shapes an engine and a trainer run: one-token decode steps of 1 and 16 rows and a 16 x 40 prefill, the
    fastest of ``BF16_PROBE_ROUNDS`` rounds of each. Timed once per process; where the CPU has AMX, bf16
    wins, where it has only AVX-512 or AVX2, it loses."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=4096, max_position_embeddings=256)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, cfg.vocab_size, shape, generator=gen) for shape in ((1, 1), (16, 1), (16, 40))]

    def timed(model: Any) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            for ids in inputs:
                model(input_ids=ids, logits_to_keep=1)
            return time.perf_counter() - t0

    fp32 = LlamaForCausalLM(cfg).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    timed(fp32), timed(bf16)  # warm-up
    rounds = [(timed(fp32), timed(bf16)) for _ in range(BF16_PROBE_ROUNDS)]  # alternating: a burst of other
    # work slows rounds of both dtypes alike, and the fastest of each is compared
    return min(b for _, b in rounds) / max(min(f for f, _ in rounds), 1e-9)


def load_model(path: str | Path, *, device: str = "cpu", dtype: Any = None) -> Any:
    """A transformers causal LM from ``path`` on ``device`` in ``dtype`` (a torch dtype or its name), in eval
    mode, its weights in this process's memory (``own_weights``)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype is not None and not isinstance(dtype, str) else resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return own_weights(model.to(device)).eval()


def own_weights(model: Any) -> Any:
    """``model`` with every parameter that is a view of a memory-mapped checkpoint copied into this process's
    memory (tied parameters stay one). transformers maps a ``*.safetensors`` file and, where the file's
    dtype is the one asked for on the CPU, the parameters are copy-on-write views of that mapping: the first
    write to each page (a trainer's first optimizer step, an engine's first weight swap) then copies it
    out of the page cache, one page fault at a time, several times slower than copying the whole file at
    once; and pages never written stay file pages the kernel may drop and read again. (A model that is
    never written, such as LoRA's frozen base, is better left mapped: its pages are shared with every process
    that maps the file.) A mapped tensor's storage is not resizable; one this process allocated is."""
    import torch

    with torch.no_grad():
        for p in model.parameters():  # a tied parameter is one Parameter: copied once, still tied
            if p.device.type == "cpu" and not p.untyped_storage().resizable():
                p.data = p.data.clone()
    return model
