"""LoRA in the embedded engine: per-request adapters give peft's own outputs (alone and in a mixed
batch), SGLang's adapter routes on a running engine, and refused adapters that leave the old ones
served."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.procs import free_port, start_process
from tracegym.engine.adapters import AdapterLoadError, EngineLora, read_adapter
from tracegym.modelfiles.formats import BASE_KEY, base_fingerprint
from tracegym.modelfiles.load import load_model

PROMPT = [1, 4093, 28, 2, 1, 1032, 34]


def make_adapter(model_dir: Path, out: Path, *, seed: int, targets: list[str], rank: int = 4) -> Path:
    """A PEFT adapter with random (non-zero) A and B, saved by peft itself."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_model(model_dir, device="cpu", dtype="float32")
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return out / "default" if (out / "default").is_dir() else out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(tiny_model_dir, root / "a", seed=1, targets=["q_proj", "v_proj", "down_proj"])
    b = make_adapter(tiny_model_dir, root / "b", seed=2, targets=["o_proj", "up_proj"], rank=2)
    return a, b


def test_per_request_adapters_match_peft_alone_and_in_a_mixed_batch(
    tiny_model_dir: Path, adapters: tuple[Path, Path]
) -> None:
    from peft import PeftModel

    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    base = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        want_base = base(input_ids=ids).logits
        want = {}
        for name, path in zip("ab", adapters, strict=True):
            ref = PeftModel.from_pretrained(load_model(tiny_model_dir, device="cpu", dtype="float32"), str(path))
            want[name] = ref(input_ids=ids).logits
    lora = EngineLora(base, torch.float32)
    for name, path in zip("ab", adapters, strict=True):
        lora.add(read_adapter(name, path, base, torch.float32))
    a, b = lora.adapters["a"], lora.adapters["b"]
    with torch.no_grad():
        lora.set_rows([a, a])
        assert torch.allclose(base(input_ids=ids).logits, want["a"], atol=1e-5)
        lora.set_rows([b, None])  # a mixed batch: row 0 adapter b, row 1 the base model
        got = base(input_ids=ids).logits
        assert torch.allclose(got[0], want["b"][0], atol=1e-5)
        assert torch.allclose(got[1], want_base[1], atol=1e-5)
        assert not torch.allclose(want["a"], want_base, atol=1e-3)  # the adapters do change the output
        lora.set_rows([None, None])
        assert torch.allclose(base(input_ids=ids).logits, want_base, atol=1e-6)


def test_adapters_for_another_model_are_refused(tiny_model_dir: Path, adapters: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    other = tmp_path / "other"
    shutil.copytree(adapters[0], other)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    save_file(tensors, str(other / "adapter_model.safetensors"), metadata={BASE_KEY: "0123456789abcdef"})
    with pytest.raises(AdapterLoadError, match="trained on another base model"):
        read_adapter("x", other, model, torch.float32)
    # right fingerprint, wrong shapes (a model with another hidden size)
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], 7)
    save_file(tensors, str(other / "adapter_model.safetensors"),
              metadata={BASE_KEY: base_fingerprint(model.config)})
    with pytest.raises(AdapterLoadError, match="the model needs"):
        read_adapter("x", other, model, torch.float32)
    conf = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**conf, "r": 0}))
    with pytest.raises(AdapterLoadError, match="rank must be > 0"):
        read_adapter("x", other, model, torch.float32)
    with pytest.raises(AdapterLoadError, match="not a LoRA adapter"):
        read_adapter("x", tmp_path / "missing", model, torch.float32)


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine-lora") / "engine.log"
    argv = ["tracegym", "engine", "--model", str(tiny_model_dir), "--port", str(port), "--dtype", "float32",
            "--weight-version", "v0"]
    with start_process(argv, port=port, log_path=log) as p, httpx.Client(base_url=p.base_url, timeout=60) as c:
        yield c


def generate(client: httpx.Client, lora: str | None = None) -> tuple[list[float], str]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def test_sglang_lora_routes_on_a_running_engine(client: httpx.Client, adapters: tuple[Path, Path],
                                                tmp_path: Path, tiny_model_dir: Path) -> None:
    base, _ = generate(client)
    r = client.post("/generate", json={"input_ids": PROMPT, "lora_path": "planner-v1"})
    assert r.status_code == 400 and "not loaded" in r.text
    r = client.post("/load_lora_adapter", json={"lora_name": "planner-v1", "lora_path": str(adapters[0])})
    assert r.status_code == 200 and r.json()["success"] and r.json()["error_message"] is None
    assert r.json()["loaded_adapters"] == {"planner-v1": str(adapters[0])}
    with_a, _ = generate(client, "planner-v1")
    assert with_a != base
    assert generate(client)[0] == base  # requests without lora_path still get the base model

    bad = tmp_path / "bad"
    shutil.copytree(adapters[1], bad)
    t = load_file(str(bad / "adapter_model.safetensors"))
    save_file(t, str(bad / "adapter_model.safetensors"), metadata={BASE_KEY: "ffffffffffffffff"})
    r = client.post("/load_lora_adapter", json={"lora_name": "planner-v2", "lora_path": str(bad)})
    assert r.status_code == 400 and not r.json()["success"] and "another base model" in r.json()["error_message"]
    assert list(r.json()["loaded_adapters"]) == ["planner-v1"]
    assert generate(client, "planner-v1")[0] == with_a  # the old adapter still serves

    # a full-weight swap still works with adapters loaded (their hooks leave parameter names alone)
    r = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "v1"})
    assert r.status_code == 200, r.text
    assert generate(client, "planner-v1")[0] == with_a
    r = client.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["new_version"] == "7"
    assert generate(client, "planner-v1")[1] == "7"
    r = client.post("/unload_lora_adapter", json={"lora_name": "planner-v1"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    assert client.post("/unload_lora_adapter", json={"lora_name": "planner-v1"}).status_code == 400
    assert client.post("/generate", json={"input_ids": PROMPT, "lora_path": "planner-v1"}).status_code == 400


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "inf-pair"])
def test_an_adapter_with_non_finite_values_is_refused(tiny_model_dir: Path, adapters: tuple[Path, Path],
                                                      tmp_path: Path, bad: object) -> None:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    broken = tmp_path / "broken"
    shutil.copytree(adapters[0], broken)
    tensors = load_file(str(broken / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[-1]
    t = tensors[key].clone()
    if bad == "inf-pair":  # +inf and -inf: a sum that is NaN, not inf
        t.view(-1)[0], t.view(-1)[1] = float("inf"), float("-inf")
    else:
        t.view(-1)[-1] = bad
    tensors[key] = t
    save_file(tensors, str(broken / "adapter_model.safetensors"), metadata={BASE_KEY: base_fingerprint(model.config)})
    with pytest.raises(AdapterLoadError, match="contains NaN or inf"):
        read_adapter("x", broken, model, torch.float32)
    read_adapter("ok", adapters[0], model, torch.float32)  # the intact one loads
