"""Hot weight swaps on a running engine: new weights change logprobs and the version; a bad checkpoint
changes nothing; a swap waits for in-flight requests (SGLang's writer lock)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.procs import free_port, start_process
from tracegym.modelfiles.load import load_model

PROMPT = [1, 4093, 28, 2, 1, 1032, 34]


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine-w") / "engine.log"
    argv = [
        "tracegym",
        "engine",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--weight-version",
        "v0",
    ]
    with (
        start_process(argv, port=port, log_path=log) as p,
        httpx.Client(base_url=p.base_url, timeout=60) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    return out


def logprobs(client: httpx.Client) -> tuple[list[float], str]:
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def update(client: httpx.Client, path: Path | str, version: str) -> httpx.Response:
    return client.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version})


def test_swap_changes_logprobs_and_version_and_bad_checkpoints_change_nothing(
    client: httpx.Client, perturbed_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    before, version = logprobs(client)
    assert version == "v0"

    r = update(client, perturbed_dir, "v1")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after, version = logprobs(client)
    assert version == "v1" and client.get("/model_info").json()["weight_version"] == "v1"
    assert client.get("/model_info").json()["model_path"] == str(perturbed_dir)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    from safetensors.torch import save_file

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(wrong / "model.safetensors"))
    for bad in (corrupt, wrong, tmp_path / "missing"):
        r = update(client, bad, "v2")
        assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"], bad
        again, version = logprobs(client)
        assert version == "v1" and again == after

    assert update(client, tiny_model_dir, "v3").json()["success"] is True
    restored, version = logprobs(client)
    assert version == "v3"
    assert restored == pytest.approx(before, abs=1e-6)


def test_swap_waits_for_in_flight_requests(client: httpx.Client, perturbed_dir: Path) -> None:
    sp = {"max_new_tokens": 300, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.post, "/generate", json={"input_ids": PROMPT, "sampling_params": sp})
        deadline = time.monotonic() + 20
        while client.get("/server_info").json()["internal_states"][0]["running_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        swap = pool.submit(update, client, perturbed_dir, "v-wait")
        first = running.result(timeout=60).json()
        assert swap.result(timeout=60).json()["success"] is True
    # The request ran to completion on the old weights and reports the version it finished under.
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    assert len(first["output_ids"]) == 300
    assert first["meta_info"]["weight_version"] != "v-wait"


def test_abort_all_requests_swaps_at_once(client: httpx.Client, tiny_model_dir: Path) -> None:
    sp = {"max_new_tokens": 5000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.post, "/generate", json={"input_ids": PROMPT, "sampling_params": sp})
        deadline = time.monotonic() + 20
        while client.get("/server_info").json()["internal_states"][0]["running_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = {"model_path": str(tiny_model_dir), "weight_version": "v-abort", "abort_all_requests": True}
        r = client.post("/update_weights_from_disk", json=body).json()
        out = running.result(timeout=10).json()
    assert r["success"] is True and r["num_paused_requests"] == 1
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert logprobs(client)[1] == "v-abort"


def test_update_on_a_paused_server_runs_at_once(client: httpx.Client, tiny_model_dir: Path) -> None:
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                client.post, "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            )
            time.sleep(0.3)
            r = update(client, tiny_model_dir, "v-paused")  # does not wait for the held request
            assert r.json()["success"] is True and not held.done()
            assert client.post("/continue_generation").status_code == 200
            assert held.result(timeout=30).json()["meta_info"]["weight_version"] == "v-paused"
    finally:
        client.post("/continue_generation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checked_tensors_refuses_nan_inf_and_wrong_shapes(dtype: torch.dtype) -> None:
    from tracegym.engine.weights import WeightLoadError, checked_tensors

    params = {"w": torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype))}
    good = torch.randn(3, 4)
    out = checked_tensors([("w", good)], params)
    assert out["w"].dtype == dtype and torch.equal(out["w"], good.to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf"), "pair"):
        t = good.clone()
        if bad == "pair":  # +inf and -inf in one tensor: their sum is NaN
            t[0, 0], t[1, 1] = float("inf"), float("-inf")
        else:
            t[2, 3] = bad
        with pytest.raises(WeightLoadError, match="w: contains NaN or inf"):
            checked_tensors([("w", t)], params)
    with pytest.raises(WeightLoadError, match=r"shape \(4, 3\) != served \(3, 4\)"):
        checked_tensors([("w", good.T)], params)


def test_a_checkpoint_is_read_in_its_own_dtype_and_cast_as_it_is_copied(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A bf16 checkpoint for fp32 weights: read as bf16 (no fp32 copy of it is made), each value cast as it is
    copied into the served parameter, which stays fp32 and in place."""
    from safetensors.torch import save_file

    from tracegym.engine.weights import apply_state, read_checkpoint, tied_parameter_names

    model = load_model(tiny_model_dir, dtype=torch.float32)
    tied = tied_parameter_names(model)
    new = {n: (p.detach() + 0.25).to(torch.bfloat16).contiguous() for n, p in model.named_parameters()
           if n not in tied}
    save_file(new, str(tmp_path / "model.safetensors"))
    state = read_checkpoint(tmp_path, model)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    apply_state(model, state)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == where[n]
        if n in new:
            assert torch.equal(p.detach(), new[n].to(torch.float32))


def test_a_nan_past_the_first_chunk_is_found() -> None:
    from tracegym.engine.weights import FINITE_CHUNK, finite_sum

    t = torch.zeros(2 * FINITE_CHUNK + 6, dtype=torch.bfloat16)
    assert finite_sum(t)
    for where in (0, FINITE_CHUNK, t.numel() - 1):
        t.zero_()
        t[where] = float("nan") if where else float("inf")
        assert not finite_sum(t.view(-1, 2)), where
