"""ONNX files are checked before use: ``predict`` on one whose declared input differs from its metadata, that
takes other inputs or gives other outputs, takes a 1-D or integer input, or gives logits that are not one row
an input, is one sentence naming the file (they were crash reports, or a prediction for some of the inputs)."""
import json

import numpy as np
import pytest

import brickyard
from brickyard.errors import BrickyardError
from conftest import run_cli

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402  only where the [onnx] extra is installed

META = {"name": "mlp", "num_classes": 10, "in_channels": 1, "image_size": [28, 28], "classes": list("0123456789"),
        "normalises": True, "format": "onnx"}


def _model(path, shape=("N", 1, 28, 28), meta=META, inputs=("images",), outputs=("logits",), dtype=TensorProto.FLOAT,
           per_input=True):
    """images -> logits N x 10 (the sum of each image times ones); ``per_input=False``: one row for the batch."""
    nodes = [helper.make_node("Cast", [inputs[0]], ["f"], to=TensorProto.FLOAT)]
    if per_input:
        nodes += [helper.make_node("ReduceSum", ["f", "axes"], ["s"], keepdims=0),
                  helper.make_node("Unsqueeze", ["s", "one"], ["flat"])]
    else:
        nodes += [helper.make_node("ReduceSum", ["f"], ["flat"], keepdims=0)]
    nodes += [helper.make_node("Mul", ["flat", "w"], [outputs[0]])]
    nodes += [helper.make_node("Identity", ["flat"], [o]) for o in outputs[1:]]
    consts = [numpy_helper.from_array(np.ones((1, 10), np.float32), "w"),
              numpy_helper.from_array(np.array([1, 2, 3], np.int64), "axes"),
              numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, dtype, list(shape)) for n in inputs],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], consts)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    entry = m.metadata_props.add()
    entry.key, entry.value = "brickyard.json", json.dumps(meta)
    onnx.save(m, str(path))
    return path


X = np.zeros((2, 1, 28, 28), np.float32)


@pytest.mark.fast
def test_a_well_formed_file_predicts_one_row_an_input(tmp_path):
    out = brickyard.predict(_model(tmp_path / "ok.onnx"), X)
    assert out["logits"].shape == (2, 10)


@pytest.mark.fast
@pytest.mark.parametrize("case, build, said", [
    ("declared", dict(shape=("N", 3, 32, 32)), "its input 'images' is declared 3x32x32 and its metadata says 1x28x28"),
    ("channels", dict(meta={**META, "in_channels": 3}), "its input 'images' is declared 1x28x28 and its metadata says 3x28x28"),
    ("inputs", dict(inputs=("images", "mask")), "takes images, mask and gives logits; brickyard's ONNX files take one"),
    ("outputs", dict(outputs=("scores",)), "takes images and gives scores; brickyard's ONNX files take one"),
    ("1-D", dict(shape=("N",), per_input=False), "its input 'images' has 1 dimension(s)"),
    ("integer", dict(dtype=TensorProto.INT64), "its input 'images' holds tensor(int64), not float images"),
    ("one row", dict(per_input=False), "gave logits of shape 1x10 for 2 input(s)"),
    ("metadata", dict(meta={**META, "image_size": [28]}), "its brickyard metadata holds image_size = [28]"),
    ("metadata type", dict(meta={**META, "in_channels": "1"}), "its brickyard metadata holds in_channels = '1'"),
])
def test_a_file_that_does_not_fit_is_one_sentence_naming_it(tmp_path, case, build, said):
    path = _model(tmp_path / "m.onnx", **build)
    with pytest.raises(BrickyardError) as e:
        brickyard.predict(path, X)
    assert said in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value), (case, str(e.value))


def test_predict_says_the_sentence_as_a_command(tmp_path):
    path = _model(tmp_path / "m.onnx", shape=("N", 3, 32, 32))
    np.save(tmp_path / "x.npy", np.zeros((2, 28, 28), np.uint8))
    r = run_cli("predict", str(path), str(tmp_path / "x.npy"))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {path}: its input 'images' is declared 3x32x32 and its metadata says 1x28x28; the file was changed "
        "after export, export it again.")
