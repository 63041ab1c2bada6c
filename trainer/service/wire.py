"""The Tinker API's wire formats: ``forward_backward`` requests as protobuf (what the ``tinker`` SDK sends,
zstd-compressed or not) or JSON (what a hand-written client may send), and the two results the SDK reads
as protobuf (``ForwardBackwardOutput``, ``SampleResponse`` with its prompt and top-k logprobs) or as JSON.
The message classes are the SDK's own generated ones (``tinker.proto.tinker_public_pb2``, the ``tinker``
extra), imported when first used.

Every malformed input raises ``BadInput`` naming the field and what it should be."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tracegym.trainer.service.steps import Datum

PROTO = "application/x-protobuf"


class BadInput(ValueError):
    """A request the service cannot run as sent (answered 400 with this message)."""


def _pb() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ModuleNotFoundError as e:  # pragma: no cover - the extra is part of [all]
        raise RuntimeError("the training service needs the tinker package: pip install 'tracegym[tinker]'") from e
    return tinker_public_pb2


@dataclass(slots=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


# ---------------------------------------------------------------- requests


def _dense(values: np.ndarray, shape: list[int], crow: np.ndarray | None, col: np.ndarray | None,
           where: str) -> np.ndarray:
    if crow is None:
        if shape and int(np.prod(shape)) != values.size:
            raise BadInput(f"{where}: {values.size} values do not fill shape {shape}")
        return values.reshape(shape) if shape else values
    if len(shape) != 2:
        raise BadInput(f"{where}: a sparse CSR tensor needs a 2-d shape, got {shape}")
    out = np.zeros(shape, dtype=values.dtype)
    if len(crow) != shape[0] + 1 or col is None or len(col) != len(values):
        raise BadInput(f"{where}: sparse CSR indices do not match shape {shape}")
    for r in range(shape[0]):
        cols = col[crow[r]:crow[r + 1]]
        if len(cols) and (cols.min() < 0 or cols.max() >= shape[1]):
            raise BadInput(f"{where}: a sparse column index is outside shape {shape}")
        out[r, cols] = values[crow[r]:crow[r + 1]]
    return out


def _tensor_from_proto(msg: Any, where: str) -> np.ndarray:
    pb = _pb()
    kinds = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32,
             pb.DTYPE_BFLOAT16: np.uint16}
    if msg.dtype not in kinds:
        raise BadInput(f"{where}: unsupported tensor dtype {msg.dtype}")
    dt = np.dtype(kinds[msg.dtype])
    raw = msg.sparse_csr.values if msg.HasField("sparse_csr") else msg.dense
    if len(raw) % dt.itemsize:
        raise BadInput(f"{where}: {len(raw)} bytes are not whole {dt} values")
    values = np.frombuffer(raw, dtype=dt)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    crow = col = None
    if msg.HasField("sparse_csr"):
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
    return _dense(values, list(msg.shape), crow, col, where)


def _datum(tokens: list[np.ndarray], inputs: dict[str, np.ndarray], where: str) -> Datum:
    ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, dtype=np.int64)
    if len(ids) == 0:
        raise BadInput(f"{where}.model_input is empty")
    if "target_tokens" not in inputs:
        raise BadInput(f"{where}.loss_fn_inputs has no target_tokens (the token each position predicts)")
    out: dict[str, np.ndarray] = {}
    for name, arr in inputs.items():
        if arr.ndim != 1:
            raise BadInput(f"{where}.loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; only 1-d inputs "
                           "(one value per position) are supported")
        if len(arr) != len(ids):
            raise BadInput(f"{where}.loss_fn_inputs[{name!r}] has {len(arr)} values but model_input has "
                           f"{len(ids)} tokens: give one per input position")
        if name != "target_tokens":
            if not np.all(np.isfinite(arr)):
                raise BadInput(f"{where}.loss_fn_inputs[{name!r}] has a NaN or infinite value")
            out[name] = arr.astype(np.float32)
    return Datum(tokens=ids, targets=inputs["target_tokens"].astype(np.int64), inputs=out)


def forward_backward_from_proto(body: bytes, content_encoding: str | None) -> ForwardBackwardCall:
    if (content_encoding or "").lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise BadInput(f"the zstd body does not decompress: {e}") from None
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise BadInput(f"the body is not a ForwardBackwardRequest protobuf: {e}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise BadInput(f"{where}.model_input[{j}] is a {kind} chunk; only token chunks (encoded_text) "
                               "are supported")
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        inputs = {k: _tensor_from_proto(v, f"{where}.loss_fn_inputs[{k!r}]") for k, v in d.loss_fn_inputs.items()}
        data.append(_datum(tokens, inputs, where))
    return ForwardBackwardCall(msg.model_id, msg.seq_id or None, msg.loss_fn, config, msg.forward_only, data)


def _json_tensor(value: Any, where: str) -> np.ndarray:
    if isinstance(value, list):
        return np.asarray(value, dtype=np.float64)
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        arr = np.asarray(value["data"], dtype=np.float64)
        shape = value.get("shape") or []
        crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
        return _dense(arr, list(shape), None if crow is None else np.asarray(crow, dtype=np.int64),
                      None if col is None else np.asarray(col, dtype=np.int64), where)
    raise BadInput(f"{where} must be a list of numbers or {{\"data\": [...], \"dtype\": ..., \"shape\": [...]}}")


def forward_backward_from_json(body: dict[str, Any], forward_only: bool) -> ForwardBackwardCall:
    """The SDK's JSON shape: ``{model_id, seq_id, forward_backward_input: {data, loss_fn, loss_fn_config}}``."""
    fbi = body.get("forward_backward_input")
    if not isinstance(fbi, dict) or not isinstance(fbi.get("data"), list):
        raise BadInput("forward_backward_input must be an object with a data list")
    data = []
    for i, d in enumerate(fbi["data"]):
        where = f"data[{i}]"
        if not isinstance(d, dict):
            raise BadInput(f"{where} must be an object")
        chunks = (d.get("model_input") or {}).get("chunks")
        if not isinstance(chunks, list):
            raise BadInput(f"{where}.model_input must be {{\"chunks\": [{{\"tokens\": [...]}}]}}")
        tokens = []
        for j, c in enumerate(chunks):
            if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text" or not isinstance(
                    c.get("tokens"), list):
                raise BadInput(f"{where}.model_input.chunks[{j}]: only token chunks ({{\"tokens\": [...]}}) "
                               "are supported")
            tokens.append(np.asarray(c["tokens"], dtype=np.int64))
        raw = d.get("loss_fn_inputs") or {}
        if not isinstance(raw, dict):
            raise BadInput(f"{where}.loss_fn_inputs must be an object")
        inputs = {k: _json_tensor(v, f"{where}.loss_fn_inputs[{k!r}]") for k, v in raw.items()}
        data.append(_datum(tokens, inputs, where))
    config = fbi.get("loss_fn_config") or {}
    if not isinstance(config, dict) or not all(isinstance(v, int | float | str) for v in config.values()):
        raise BadInput("loss_fn_config must be an object of numbers and strings")
    seq = body.get("seq_id")
    return ForwardBackwardCall(str(body.get("model_id", "")), seq if isinstance(seq, int) else None,
                               str(fbi.get("loss_fn", "")), dict(config), forward_only, data)


# ---------------------------------------------------------------- results


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float], proto: bool) -> Any:
    """``ForwardBackwardOutput``: one ``ArrayRecord`` holding every datum's fields (protobuf bytes), or JSON."""
    if not proto:
        return {"loss_fn_output_type": "ArrayRecord", "metrics": metrics,
                "loss_fn_outputs": [{k: {"data": v.astype(float).tolist(), "dtype": "float32", "shape": [len(v)]}
                                     for k, v in o.items()} for o in outputs]}
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [o[name].astype(np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].data = b"".join(a.tobytes() for a in arrays)
        record.fields[name].offsets = offsets.tobytes()
        record.fields[name].dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclass(slots=True)
class TopK:
    """Top-k logprobs at each position: ``rows[i]`` holds up to ``k`` (token id, logprob), most likely
    first, or None where nothing was computed."""

    k: int
    rows: list[list[tuple[int, float]] | None]


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    """``stop`` or ``length``."""
    topk: TopK | None = None
    """``topk_sample_logprobs``: one row per token."""


@dataclass(slots=True)
class SampleResult:
    sequences: list[Sampled]
    prompt_logprobs: list[float | None] | None = None
    """One per prompt token (None: not computed, as for the first), when asked for."""
    topk_prompt: TopK | None = None
    """``topk_prompt_logprobs``: one row per prompt token."""


def _topk_json(t: TopK | None) -> list[list[list[float]] | None] | None:
    return None if t is None else [None if row is None else [[tid, lp] for tid, lp in row] for row in t.rows]


def _topk_proto(msg: Any, t: TopK) -> None:
    """The SDK's ``TopkLogprobs``: dense ``[len(rows), k]`` matrices, empty cells (and rows) filled with its
    sentinel (token 0, ``MASK_LOGPROB``)."""
    from tinker.types.topk_logprobs import MASK_LOGPROB

    ids = np.zeros((len(t.rows), t.k), dtype=np.int32)
    lps = np.full((len(t.rows), t.k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(t.rows):
        for j, (tid, lp) in enumerate((row or [])[: t.k]):
            ids[i, j], lps[i, j] = tid, lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), t.k, len(t.rows)


def sample_response(result: SampleResult, proto: bool) -> Any:
    if not proto:
        out: dict[str, Any] = {"type": "sample", "sequences": [
            {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
            | ({} if s.topk is None else {"topk_logprobs": _topk_json(s.topk)}) for s in result.sequences]}
        if result.prompt_logprobs is not None:
            out["prompt_logprobs"] = result.prompt_logprobs
        if result.topk_prompt is not None:
            out["topk_prompt_logprobs"] = _topk_json(result.topk_prompt)
        return out
    pb = _pb()
    msg = pb.SampleResponse()
    for s in result.sequences:
        seq = msg.sequences.add(stop_reason=pb.STOP_REASON_LENGTH if s.stop_reason == "length" else pb.STOP_REASON_STOP,
                                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
        if s.topk is not None:
            _topk_proto(seq.topk_sampled_logprobs, s.topk)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([np.nan if x is None else x for x in result.prompt_logprobs],
                                         dtype=np.float32).tobytes()
    if result.topk_prompt is not None:
        _topk_proto(msg.topk_prompt_logprobs, result.topk_prompt)
    return msg.SerializeToString()
