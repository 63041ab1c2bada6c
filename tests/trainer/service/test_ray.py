"""``tinker-serve --ray`` (tiny-random, fp32): each run's workers are Ray actors on a Ray the service starts,
one rank or two FSDP2 ranks (gloo). The same requests as on the in-process service (``forward_backward``
with every loss, ``optim_step``, ``forward``, ``save_state``, publish, sample) give the same losses,
logprobs, gradient norm and published adapters within fp32 tolerance; a failed ``optim_step`` answers the
same message; a run that does not fit the Ray's free CPUs is refused saying so; a saved state loads into a
new run; and the service leaves no Ray process behind."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.trainer.service.conftest import MODEL, Service, datum, fb_body, result, session, tiny_service

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LOSSES: list[tuple[str, dict[str, float]]] = [
    ("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}), ("cispo", {}), ("dro", {"beta": 0.1}),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("tracegym/sft", {}), ("tracegym/grpo", {}),
]
PROMPT = [1, 504, 3300, 28, 253, 1848, 1102, 30, 2]


def _data() -> list[dict[str, Any]]:
    """Three datums of different lengths with every input the losses read (more datums than two ranks)."""
    rng = np.random.default_rng(11)
    out = []
    for n in (9, 23, 14):
        ids = rng.integers(3, 4000, n + 1).tolist()
        out.append(datum(ids[:-1], ids[1:], weights=[0.0, 0.0] + [1.0] * (n - 2),
                         advantages=rng.normal(size=n).round(3).tolist(),
                         logprobs=(-rng.uniform(1, 9, n)).round(3).tolist(), sequence_ratio_mask=[1.0] * n))
    return out


def _logprobs(answer: dict[str, Any]) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"]["data"]) for o in answer["loss_fn_outputs"]]


def _steps(c: httpx.Client, svc: Service) -> dict[str, Any]:
    """One run through every operation; what each answered."""
    sid = session(c)
    run = result(c, c.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                                         "lora_config": {"rank": 4, "seed": 5}}))["model_id"]
    data = _data()
    fb = [result(c, c.post("/api/v1/forward_backward", json=fb_body(run, data, loss, **config)))
          for loss, config in LOSSES]
    step = result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))["metrics"]
    again = result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))
    fwd = result(c, c.post("/api/v1/forward", json=fb_body(run, data)))
    saved = result(c, c.post("/api/v1/save_weights", json={"model_id": run, "path": "one"}))["path"]
    pub = result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": run, "sampling_session_seq_id": 0}))
    sample = result(c, c.post("/api/v1/asample", json={
        "sampling_session_id": pub["sampling_session_id"], "num_samples": 1, "prompt_logprobs": True,
        "prompt": {"chunks": [{"tokens": PROMPT}]}, "sampling_params": {"max_tokens": 2, "seed": 0}}))
    prompt_fwd = result(c, c.post("/api/v1/forward", json=fb_body(run, [datum(PROMPT[:-1], PROMPT[1:])])))
    version_dir = svc.state_dir / "weights" / run.replace(":", "_") / f"v{pub['path'].rsplit('/', 1)[1]}"
    adapters = {f"{p.parent.name}/{k}": v for p in sorted(version_dir.rglob("*.safetensors"))
                for k, v in load_file(str(p)).items()}
    return {"run": run, "session": sid, "fb": fb, "step": step, "again": again, "fwd": fwd, "saved": saved,
            "sample": sample, "prompt_fwd": prompt_fwd, "adapters": adapters}


@pytest.fixture(scope="module")
def in_process(service: Service) -> dict[str, Any]:
    with service.client() as c:
        return _steps(c, service)


def _ray_processes(ray_tmp: Path) -> list[str]:
    """Live processes of the Ray under ``ray_tmp``: its directory on their command line, or a worker pid its
    session's logs name (``logs/worker-<id>-<job>-<pid>.out``) that is still a Ray worker."""
    workers = {int(f.stem.rsplit("-", 1)[1]) for f in ray_tmp.rglob("worker-*.out")}
    found = []
    for d in (d for d in Path("/proc").iterdir() if d.name.isdigit()):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(ray_tmp) in cmd or (int(d.name) in workers and (cmd.startswith("ray::") or "default_worker" in cmd)):
            found.append(f"{d.name} {cmd[:160]}")
    return found


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def ray_service(request: pytest.FixtureRequest, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, int]]:
    """``tinker-serve --ray --num-workers N`` on a Ray of its own (2 CPUs: one run of two ranks fills it);
    afterwards, none of that Ray's processes is left."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="tg-ray-", dir="/tmp"))  # short: Ray's socket paths
    flags = ("--ray", "--num-workers", str(request.param))
    try:
        with tiny_service(tmp_path_factory.mktemp(f"tinker-ray{request.param}"), *flags,
                          env={"RAY_TMPDIR": str(ray_tmp)}) as svc:
            yield svc, request.param
        deadline = time.monotonic() + 30
        while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "processes left behind:\n" + "\n".join(left)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_a_run_on_ray_answers_as_the_in_process_one(ray_service: tuple[Service, int],
                                                    in_process: dict[str, Any]) -> None:
    svc, ranks = ray_service
    with svc.client() as c:
        ours = _steps(c, svc)
        assert f"ray: each training run is {ranks} rank(s) on a Ray it started" in svc.proc.log()
        if ranks == 2:  # the run's two ranks hold both CPUs: a second run is refused, not left pending
            refused = result(c, c.post("/api/v1/create_model", json={
                "session_id": session(c), "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}))
            assert refused["error"].startswith("a training run's 2 Ray workers need 2 CPUs (0 free); the live runs")
        assert c.post(f"/api/v1/sessions/{ours['session']}/finish").status_code == 200
        loaded = result(c, c.post("/api/v1/load_weights", json={
            "session_id": session(c), "model_seq_id": 0, "path": ours["saved"], "optimizer": True}))
        fwd = result(c, c.post("/api/v1/forward", json=fb_body(loaded["model_id"], _data())))
    theirs = in_process
    for mine, other in zip(ours["fb"], theirs["fb"], strict=True):
        assert mine["metrics"]["loss:sum"] == pytest.approx(other["metrics"]["loss:sum"], rel=1e-5, abs=1e-6)
        assert mine["metrics"]["tokens:sum"] == other["metrics"]["tokens:sum"]
        for a, b in zip(_logprobs(mine), _logprobs(other), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert ours["step"]["grad_norm"] == pytest.approx(theirs["step"]["grad_norm"], rel=1e-5)
    assert ours["step"]["step"] == theirs["step"]["step"] == 1
    assert ours["again"]["error"] == theirs["again"]["error"]
    assert ours["again"]["error"].startswith("optim_step without gradients")
    for a, b in zip(_logprobs(ours["fwd"]), _logprobs(theirs["fwd"]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert ours["adapters"].keys() == theirs["adapters"].keys() and ours["adapters"]
    for k, v in ours["adapters"].items():
        np.testing.assert_allclose(v, theirs["adapters"][k], atol=1e-5, err_msg=k)
    sampled = np.asarray(ours["sample"]["prompt_logprobs"][1:], dtype=float)
    np.testing.assert_allclose(sampled, _logprobs(ours["prompt_fwd"])[0], atol=2e-3)  # the engine serves them
    np.testing.assert_allclose(sampled, np.asarray(theirs["sample"]["prompt_logprobs"][1:], dtype=float), atol=1e-4)
    assert [a.tolist() for a in _logprobs(fwd)] == [a.tolist() for a in _logprobs(ours["fwd"])]
