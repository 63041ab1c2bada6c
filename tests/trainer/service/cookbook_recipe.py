"""Runs one of tinker-cookbook's recipes (``recipes/sl_loop.py`` or ``recipes/rl_loop.py``, their ``main``
unchanged) against a ``tracegym tinker-serve``, with the three lookups they make outside the API pointed at
local things: the tokenizer of the model name (the cookbook's ``register_tokenizer``), the renderer for it
(the model's ChatML format, ``qwen3_instruct``'s ``<|im_start|>`` turns) and the dataset (the quickstart's
"What is A+B?" tasks in the recipe's dataset's shape; the supervised answers end in ``\\boxed{sum}``, the form
the RL recipe's grader reads). ``START_STATE`` (rl): a saved state to start from, handed to the recipe as its
own resume record (``checkpoints.jsonl`` at batch 0). Used by ``test_tinker_cookbook.py``.

    python cookbook_recipe.py sl|rl BASE_URL MODEL MODEL_DIR LOG_PATH STEPS [START_STATE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets

TASKS = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "train.jsonl"


def _tasks() -> list[dict]:
    return [json.loads(line)["input"] for line in TASKS.read_text().splitlines() if line.strip()]


def _sl_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": t["question"]},
                          {"role": "assistant", "content": f"{t['question'][8:-1]} = \\boxed{{{t['answer']}}}"}]}
            for t in _tasks()]


def _rl_rows() -> list[dict]:  # GSM8K's shape: the final answer after "####"
    return [{"question": t["question"], "answer": f"{t['question'][8:-1]} = {t['answer']}\n#### {t['answer']}"}
            for t in _tasks()]


def main(kind: str, base_url: str, model: str, model_dir: str, log_path: str, steps: int,
         start_state: str | None = None) -> None:
    from tinker_cookbook import model_info, tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(model, lambda: AutoTokenizer.from_pretrained(model_dir))
    model_info.get_recommended_renderer_name = lambda name: "qwen3_instruct"
    rows = _sl_rows() if kind == "sl" else _rl_rows()
    datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    if kind == "sl":
        from tinker_cookbook.recipes import sl_loop

        sl_loop.main(sl_loop.Config(base_url=base_url, log_path=log_path, model_name=model, batch_size=8,
                                    learning_rate=3e-4, max_length=256, lora_rank=16, save_every=0,
                                    max_steps=steps))
    else:
        from tinker_cookbook.recipes import rl_loop

        if start_state:
            Path(log_path).mkdir(parents=True, exist_ok=True)
            record = {"name": "start", "batch": 0, "state_path": start_state}
            (Path(log_path) / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
        rl_loop.main(rl_loop.Config(base_url=base_url, log_path=log_path, model_name=model, batch_size=8,
                                    group_size=4, learning_rate=5e-4, lora_rank=16, save_every=0,
                                    max_tokens=48, loss_fn="importance_sampling", max_steps=steps))


if __name__ == "__main__":
    main(*sys.argv[1:6], int(sys.argv[6]), *sys.argv[7:8])
