"""A Qwen3 (``qwen3-tiny``'s architecture, tokenizer and chat template) whose weights make it write fixed
replies, so end-to-end tests can watch the embedded engine *sample* a ``<think>`` block and a tool call.

Random weights never write ``<think>``; these are set so the model is a bigram chain: attention and MLP
outputs are zeroed (the residual stream is the current token's embedding), each chain token's embedding is
its own basis direction, and the (untied) LM head scores that token's successor ~34 logits above the rest.
The engine samples it like any model (real forward passes, real logprobs, temperature 1); a reply starts
from the prompt's last token (``\\n`` after ``<|im_start|>assistant``, or ``\\n\\n`` after the empty think
block of ``enable_thinking: false``), so each chain's tokens must be distinct ids."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

THINKING_REPLY = '<think>I add.</think><tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
"""Written after ``<|im_start|>assistant\\n``: reasoning, then a call (Qwen3's tags, compact JSON)."""
PLAIN_REPLY = "It is 5."
"""Written after ``<think>\\n\\n</think>\\n\\n`` (``enable_thinking: false``)."""
LOGIT_SCALE = 6.0


def _segment(tok: object, text: str, banned: set[int]) -> list[int]:
    """Ids whose decoded pieces concatenate to ``text``, none repeated or in ``banned`` (longest first)."""
    vocab = tok.get_vocab()  # type: ignore[attr-defined]
    pieces: dict[str, list[tuple[str, int]]] = {}
    for i in vocab.values():
        s = tok.decode([i], skip_special_tokens=False)  # type: ignore[attr-defined]
        if s and "\ufffd" not in s:
            pieces.setdefault(s[0], []).append((s, i))
    for options in pieces.values():
        options.sort(key=lambda p: (-len(p[0]), p[1]))
    used, out = set(banned), []

    def dfs(pos: int) -> bool:
        if pos == len(text):
            return True
        for s, i in pieces.get(text[pos], []):
            if i not in used and text.startswith(s, pos):
                used.add(i)
                out.append(i)
                if dfs(pos + len(s)):
                    return True
                used.discard(i)
                out.pop()
        return False

    if not dfs(0):
        raise ValueError(f"no segmentation of {text!r} into distinct tokens")
    return out


def build_scripted_qwen3(src: Path, dest: Path) -> dict[str, list[int]]:
    """Write the scripted model to ``dest`` (tokenizer files from ``src``, a prepared ``qwen3-tiny``);
    returns each reply's output ids (the stop token ``<|im_end|>`` included)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    from tracegym.modelfiles.qwen3_tiny import QWEN3_EOS_IDS, qwen3_tiny_config

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    newline, blank, eos = tok.token_to_id("Ċ"), tok.token_to_id("ĊĊ"), QWEN3_EOS_IDS[0]
    thinking = _segment(tok, THINKING_REPLY, {newline, blank, eos})
    plain = _segment(tok, PLAIN_REPLY, {newline, blank, eos, *thinking})
    chains = [[newline, *thinking, eos], [blank, *plain, eos]]
    config = qwen3_tiny_config()
    config.tie_word_embeddings = False
    config.hidden_size, config.head_dim = 64, 16  # a basis direction per chain step
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        steps = [pair for chain in chains for pair in itertools.pairwise(chain)]
        if len(steps) > config.hidden_size:
            raise ValueError(f"{len(steps)} chain steps need more than {config.hidden_size} dimensions")
        for k, (token, successor) in enumerate(steps):
            direction = torch.zeros(config.hidden_size)
            direction[k] = 1.0
            emb[token] = direction
            head[successor] += LOGIT_SCALE * direction
    model.generation_config.eos_token_id = list(QWEN3_EOS_IDS)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dest / name)
    assert json.loads((dest / "config.json").read_text())["tie_word_embeddings"] is False
    return {THINKING_REPLY: [*thinking, eos], PLAIN_REPLY: [*plain, eos]}
