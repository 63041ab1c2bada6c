"""A real gateway in a thread, in front of an engine or the SGLang fake, for the weight-push tests; and how
they compare an engine's logprobs of a fixed prompt with a trainer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.gateway.app_support import MemoryRecorder, ServerThread
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings


def weights_gateway(upstream: str, model_dir: Path, kind: str = "sglang", weights_dir: Path | None = None) -> ServerThread:
    """``weights_dir``: the gateway's weights root (pytest's base temporary directory holds every tmp_path)."""
    settings = GatewaySettings(upstream_url=upstream, upstream_kind=kind, model=str(model_dir), store_url=None,
                               weights_dir=str(weights_dir) if weights_dir else None)
    return ServerThread(create_app(settings, recorder=MemoryRecorder()))


PROMPT = [1, 4093, 28, 2, 1, 1032, 34]


def engine_greedy(base_url: str, max_new_tokens: int) -> tuple[list[int], list[float], str]:
    """An engine's greedy continuation of ``PROMPT`` (``/generate``): its token ids, their logprobs and the
    weight version that served it."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base_url + "/generate", timeout=60,
                   json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    toks = meta["output_token_logprobs"]
    return [t[1] for t in toks], [t[0] for t in toks], meta["weight_version"]


def logprobs_under(state: dict[str, Any], model_dir: Path, output_ids: list[int]) -> list[float]:
    """The logprobs of ``output_ids`` after ``PROMPT`` under ``state`` (a trainer's gathered weights, or the
    weights it saved: every tensor of the model, the tied ``lm_head`` aside)."""
    import torch

    from tracegym.modelfiles.load import load_model

    model = load_model(model_dir, device="cpu", dtype="float32")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + output_ids])).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(output_ids)]
