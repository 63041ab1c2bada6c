"""The real SmolLM2-135M-Instruct (prepared from its GGUF when the hub is unreachable) answers a sum."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.procs import free_port, start_process


@pytest.mark.slow
def test_smollm2_answers_two_plus_three(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tracegym.modelfiles.prepare import prepare_model

    path = prepare_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]

    port = free_port()
    argv = ["tracegym", "engine", "--model", "smollm2-135m", "--port", str(port)]
    with start_process(argv, port=port, log_path=tmp_path / "engine.log") as engine:
        body = {
            "input_ids": ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0},
        }
        out = httpx.post(engine.base_url + "/generate", json=body, timeout=120).json()
    assert "5" in out["text"], out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # <|im_end|>
    assert out["output_ids"][-1] == 2
