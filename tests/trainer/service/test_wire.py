"""The wire formats against the ``tinker`` SDK's own encoders and decoders: what the SDK sends is read back
exactly (dense, sparse, zstd), what the service answers the SDK decodes, and malformed input names its
field."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tracegym.trainer.service.wire import (
    BadInput,
    Sampled,
    SampleResult,
    TopK,
    forward_backward_from_json,
    forward_backward_from_proto,
    forward_backward_output,
    sample_response,
)


def _request(data: list[types.Datum], loss: str = "ppo", config: dict | None = None) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="s-1:train:0", seq_id=7)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_an_sdk_request_is_read_back_exactly() -> None:
    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [0.0, -1.5, -2.25],
                                    "advantages": [0.0, 1.0, 1.0]})
    call = forward_backward_from_proto(_request([d], config={"clip_low_threshold": 0.7}), None)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s-1:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    [got] = call.data
    assert got.tokens.tolist() == [5, 6, 7] and got.targets.tolist() == [6, 7, 8]
    assert got.inputs["logprobs"].tolist() == [0.0, -1.5, -2.25]


def test_a_zstd_body_is_read_and_a_2d_sparse_input_is_refused_by_name() -> None:
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 1.0, 0.0, 0.5]})
    call = forward_backward_from_proto(zstandard.ZstdCompressor().compress(_request([d], "cross_entropy")), "zstd")
    assert call.data[0].inputs["weights"].tolist() == [0.0, 1.0, 0.0, 0.5]
    topk = types.TensorData(data=[7, 9], dtype="int64", shape=[4, 2], sparse_crow_indices=[0, 1, 1, 2, 2],
                            sparse_col_indices=[0, 1])  # top-k targets, one row per position
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": topk})
    with pytest.raises(BadInput, match=r"target_tokens'\] has shape \[4, 2\]; only 1-d inputs"):
        forward_backward_from_proto(_request([d], "cross_entropy"), None)


def test_weights_of_the_wrong_length_name_the_datum_and_the_input() -> None:
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]})
    with pytest.raises(BadInput, match=r"data\[0\]\.loss_fn_inputs\['weights'\] has 2 values but model_input has 3"):
        forward_backward_from_proto(_request([d], "cross_entropy"), None)


def test_json_requests_take_lists_or_tensor_objects() -> None:
    body = {"model_id": "m", "seq_id": 3, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [
        {"model_input": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}, "weights": [1, 0]}}]}}
    call = forward_backward_from_json(body, forward_only=True)
    assert call.forward_only and call.seq_id == 3
    assert call.data[0].targets.tolist() == [2, 3] and call.data[0].inputs["weights"].tolist() == [1.0, 0.0]
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"] = [1, float("nan")]
    with pytest.raises(BadInput, match="NaN"):
        forward_backward_from_json(body, forward_only=False)
    del body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]
    with pytest.raises(BadInput, match="no target_tokens"):
        forward_backward_from_json(body, forward_only=False)


def test_results_decode_with_the_sdk() -> None:
    outputs = [{"logprobs": np.array([-1.0, -2.0], np.float32), "elementwise_loss": np.array([0.0, 2.0], np.float32)},
               {"logprobs": np.array([-0.5], np.float32), "elementwise_loss": np.array([0.5], np.float32)}]
    fb = deserialize_forward_backward_output(forward_backward_output(outputs, {"loss:sum": 2.5}, proto=True))
    assert fb.metrics == {"loss:sum": 2.5}
    assert [o["logprobs"].tolist() for o in fb.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert fb.loss_fn_outputs[1]["elementwise_loss"].tolist() == [0.5]
    sr = deserialize_sample_response(sample_response(SampleResult([Sampled([4, 5, 2], [-0.1, -0.2, -0.3], "stop"),
                                                                   Sampled([9], [-1.0], "length")]), proto=True))
    assert [s.tokens_np.tolist() for s in sr.sequences] == [[4, 5, 2], [9]]
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length"]
    assert sr.sequences[0].logprobs_np.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert sr.prompt_logprobs is None and sr.topk_prompt_logprobs is None and sr.sequences[0].topk_logprobs is None


def test_prompt_and_topk_logprobs_decode_with_the_sdk() -> None:
    result = SampleResult(
        [Sampled([4, 5], [-0.1, -0.2], "length", TopK(2, [[(4, -0.1), (7, -0.9)], [(5, -0.2)]]))],
        prompt_logprobs=[None, -1.5, -2.5],
        topk_prompt=TopK(3, [None, [(8, -0.5), (3, -1.5), (1, -2.0)], [(2, -0.25), (6, -2.5), (9, -3.0)]]))
    sr = deserialize_sample_response(sample_response(result, proto=True))
    assert sr.prompt_logprobs == pytest.approx([None, -1.5, -2.5])
    assert sr.topk_prompt_logprobs == [None, [(8, -0.5), (3, -1.5), (1, -2.0)], [(2, -0.25), (6, -2.5), (9, -3.0)]]
    assert sr.sequences[0].topk_logprobs == [[(4, pytest.approx(-0.1)), (7, pytest.approx(-0.9))],
                                             [(5, pytest.approx(-0.2))]]  # a short row: the sentinel cut off
    as_json = sample_response(result, proto=False)
    assert as_json["prompt_logprobs"] == [None, -1.5, -2.5]
    assert as_json["topk_prompt_logprobs"][1] == [[8, -0.5], [3, -1.5], [1, -2.0]]
    assert as_json["sequences"][0]["topk_logprobs"] == [[[4, -0.1], [7, -0.9]], [[5, -0.2]]]
