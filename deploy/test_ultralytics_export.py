"""ultralytics' own exporter, ``model.export(format=...)``, on RT-DETR-l built from its yaml (random weights, no
download), patched with msda_core.patch. ``format="onnx"`` calls torch.onnx.export(dynamo=False), whose msda symbolic
emits the gather form, so the graph has no GridSample; onnxruntime and OpenVINO run it. ``format="openvino"`` traces
with TorchScript, which keeps msda::deform_attn as one node OpenVINO does not know (test_openvino.py asserts it on
the op alone); inside ``msda_core.export.portable()`` it converts, and OpenVINO runs it. "coreml" and "litert" take
the same call; a whole RT-DETR-l costs 48 and 122 s there, so CI checks their converters under it on the op alone
(test_coreml.py, test_litert.py)."""

import os
import time
from pathlib import Path

import msda_core
import msda_testkit as kit
import numpy as np
import onnx
import onnxruntime
import torch
from harness import Row, check, compile_openvino, version

FP32 = kit.tolerance(torch.float32, "forward")
IMAGE_SIZE = 160  # strides 8, 16, 32: levels of 20x20, 10x10, 5x5: 525 anchors for the decoder's top 300


def patched_rtdetr_l():
    from ultralytics import RTDETR

    torch.manual_seed(0)
    front_end = RTDETR("rtdetr-l.yaml")
    assert msda_core.patch(front_end.model).patched
    return front_end


def export(front_end, tmp_path, row: Row, format: str) -> str:
    """``front_end.export(format=...)`` at IMAGE_SIZE on the CPU, timed into the row; the path it wrote."""
    cwd = os.getcwd()
    os.chdir(tmp_path)  # ultralytics writes beside the weights it names: here, the test's folder
    try:
        start = time.perf_counter()
        path = str(tmp_path / front_end.export(format=format, imgsz=IMAGE_SIZE, device="cpu", verbose=False))
        row.convert_s = time.perf_counter() - start
    finally:
        os.chdir(cwd)
    return path


def image_and_expected(front_end):
    image = torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1))
    network = front_end.model.fuse().eval()  # as the exporter fuses each Conv with its BatchNorm
    with torch.no_grad():
        return image, network(image)[0]


def test_patched_rtdetr_l_through_format_onnx(tmp_path, record):
    front_end = patched_rtdetr_l()
    row = Row("onnxruntime", onnxruntime.__version__, "ultralytics rtdetr-l", 'export(format="onnx") (gather)',
              "fp32", "none (ultralytics' default)")
    path = export(front_end, tmp_path, row, "onnx")
    model = onnx.load(path)
    assert "GridSample" not in {n.op_type for n in model.graph.node}
    image, expected = image_and_expected(front_end)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    check(row, in_row_order(session.run(None, {session.get_inputs()[0].name: image.numpy()})), in_row_order([expected]),
          FP32, "onnxruntime")
    record(row)
    row = Row("OpenVINO", version("openvino"), "ultralytics rtdetr-l", 'export(format="onnx") (gather)', "fp32",
              "none (ultralytics' default)", convert_s=row.convert_s)
    outputs = compile_openvino(path)([image.numpy()]).values()
    check(row, in_row_order(list(outputs)), in_row_order([expected]), FP32, "OpenVINO")
    record(row)


def test_patched_rtdetr_l_through_format_openvino_under_portable(tmp_path, record):
    front_end = patched_rtdetr_l()
    row = Row("OpenVINO", version("openvino"), "ultralytics rtdetr-l", 'export(format="openvino") in portable()',
              "fp32", "none (ultralytics' default)")
    with msda_core.export.portable():
        folder = export(front_end, tmp_path, row, "openvino")
    (xml,) = Path(folder).glob("*.xml")
    image, expected = image_and_expected(front_end)
    outputs = compile_openvino(str(xml))([image.numpy()]).values()
    check(row, in_row_order(list(outputs)), in_row_order([expected]), FP32)
    record(row)


def in_row_order(outputs) -> list:
    """Each (1, 300, 4 + classes) output with its queries sorted by their box: the decoder's top-300 selection over
    near-equal random-weight scores may order two queries differently after fp32 rounding in another runtime."""
    out = torch.as_tensor(outputs[0])[0]
    keys = [out[:, i] for i in reversed(range(4))]
    order = torch.from_numpy(np.lexsort([k.numpy() for k in keys]))
    return [out[order]]
