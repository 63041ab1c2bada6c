"""What SmolLM2-135M does with the tool agent's protocol before any training (examples/tool_agent).

    python -m benchmarks.tool_probe [--samples 128] [--temperature 1.0]

For each way of asking (the protocol as a system instruction, in the question, as one worked exchange, or
both), it samples first replies to held-out questions and counts replies that call the tool
(``LOOKUP <word>``) and valid calls (the asked colour); then, given a valid call and its result, how often
the next reply states the code; and how often a nudge after a missed call brings a valid call. The tool agent
uses the prompt whose first replies call the tool rarely but not never: GRPO needs some successes in a
group to learn from, and room above them to show it (docs/agents.md)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "tool_agent"))

from agent import CALL, EXAMPLE, NUDGE, lookup, reward  # noqa: E402  (the example's own protocol)

INSTRUCTION = ("You can look up the secret code of any box. To look it up, reply with exactly one line: "
               "LOOKUP <colour>. You will get the code back; then reply with the code.")


def question(colour: str) -> str:
    return f"What is the secret code of the {colour} box?"


PROMPTS = {
    "instruction as system prompt": lambda c: [{"role": "system", "content": INSTRUCTION},
                                               {"role": "user", "content": question(c)}],
    "instruction in the question": lambda c: [{"role": "user", "content": f"{question(c)} {INSTRUCTION}"}],
    "instruction + worked exchange": lambda c: [{"role": "system", "content": INSTRUCTION}, *EXAMPLE,
                                                {"role": "user", "content": question(c)}],
    "worked exchange (the agent's)": lambda c: [*EXAMPLE, {"role": "user", "content": question(c)}],
}


class Sampler:
    def __init__(self, temperature: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tracegym.modelfiles.prepare import prepare_model

        path = prepare_model("smollm2-135m")
        self.torch, self.temperature = torch, temperature
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 2

    def replies(self, conversations: list[list[dict[str, str]]], max_new: int = 20) -> list[str]:
        torch, out = self.torch, []
        texts = [self.tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        prompts = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        for i in range(0, len(prompts), 64):
            chunk = prompts[i:i + 64]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.no_grad():
                gen = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_p=1.0, top_k=0,
                                          temperature=self.temperature, max_new_tokens=max_new, pad_token_id=self.pad)
            out += [self.tok.decode(row[width:], skip_special_tokens=True) for row in gen.tolist()]
        return out


def probe(sampler: Sampler, tasks: list[dict[str, Any]], build: Any) -> dict[str, float]:
    first = sampler.replies([build(t["colour"]) for t in tasks])
    calls = [CALL.search(r) for r in first]
    valid = [bool(c) and c.group(1).lower() == t["colour"] for c, t in zip(calls, tasks, strict=True)]
    given = [[*build(t["colour"]), {"role": "assistant", "content": f"LOOKUP {t['colour']}"},
              {"role": "user", "content": lookup(t["codes"], t["colour"])}] for t in tasks]
    states = [reward(r, t["answer"]) for r, t in zip(sampler.replies(given), tasks, strict=True)]
    missed = [(t, r) for t, r, c in zip(tasks, first, calls, strict=True) if not c]
    nudged = sampler.replies([[*build(t["colour"]), {"role": "assistant", "content": r},
                               {"role": "user", "content": NUDGE}] for t, r in missed]) if missed else []
    after_nudge = [bool((c := CALL.search(r)) and c.group(1).lower() == t["colour"])
                   for r, (t, _) in zip(nudged, missed, strict=True)]
    n = len(tasks)
    return {"tool_call": sum(map(bool, calls)) / n, "valid_call": sum(valid) / n,
            "states_code_after_result": sum(states) / n,
            "valid_call_after_nudge": sum(after_nudge) / len(missed) if missed else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=128, help="replies sampled per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    held = [json.loads(x)["input"] for x in (REPO / "examples/tool_agent/eval.jsonl").read_text().splitlines()]
    rng = random.Random(args.seed)
    tasks = [rng.choice(held) for _ in range(args.samples)]
    sampler = Sampler(args.temperature)
    sampler.torch.manual_seed(args.seed)
    print(f"{'prompt':32s} {'tool call':>9s} {'valid':>6s} {'code|result':>11s} {'valid|nudge':>11s}")
    for name, build in PROMPTS.items():
        m = probe(sampler, tasks, build)
        print(f"{name:32s} {m['tool_call']:9.2f} {m['valid_call']:6.2f} {m['states_code_after_result']:11.2f} "
              f"{m['valid_call_after_nudge']:11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
