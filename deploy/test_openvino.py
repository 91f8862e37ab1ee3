"""OpenVINO's CPU plugin: both standard ONNX forms (the graphs onnxruntime runs), the detector's ONNX graph, and the
torch.export route (``ov.convert_model`` of the program msda's decomposition table leaves), with batch and queries
dynamic. OpenVINO's own TorchScript route (what ultralytics' format="openvino" calls) meets msda::deform_attn as an
op it does not know (asserted), and converts under ``msda_core.export.portable()``."""

from pathlib import Path

import msda_core
import msda_testkit as kit
import openvino as ov
import pytest
import torch
from harness import (
    DECODER,
    ENCODER,
    STANDARD_FORMS,
    Attention,
    Row,
    Timer,
    check,
    compile_openvino,
    decomposed,
    detector,
    detector_graph,
    eager,
    images,
    op_graph,
    op_inputs,
    small_dynamic_shapes,
    version,
)

FP32 = kit.tolerance(torch.float32, "forward")
VERSION = version("openvino")
FUSION = "MultiScaleDeformableAttnFusion"  # the pass of openvino PR #31191 (open, not in a release yet)


def run(compiled, args) -> list:
    return list(compiled([a.numpy() for a in args]).values())


def layer_types(compiled) -> set:
    return {op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()}


@pytest.mark.parametrize("form", STANDARD_FORMS)
@pytest.mark.parametrize("shape", [DECODER, ENCODER], ids=lambda s: s.name)
def test_op_onnx(shape, form, record):
    """The compiled model keeps GridSample in the grid_sample form and has none in the gather form: this release
    has no pass that fuses the pattern into one MSDA node (test below)."""
    row = Row("OpenVINO", VERSION, f"op {shape.name}", f"ONNX {form}", "fp32", "batch, queries")
    data = op_graph(shape, form, row=row)
    with Timer(row):
        compiled = compile_openvino(ov.Core().read_model(data, b""))
    assert ("GridSample" in layer_types(compiled)) == (form == "grid_sample")
    model = Attention(shape.levels)
    for batch, queries in ((1, 7), (3, 45)):
        args = op_inputs(shape, batch, queries, seed=batch)
        check(row, run(compiled, args), eager(model, args), FP32, f"B{batch} Q{queries}")
    record(row)


def test_this_release_has_no_msda_fusion():
    """OpenVINO's fusion of the GridSample pattern into one MSDA node (PR #31191: the pass
    MultiScaleDeformableAttnFusion and the op ov::op::internal::MSDA, for its GPU plugin) is not in this release:
    neither name is in any of its libraries. When a release has it, this fails, and the form's pattern must be
    checked against the pass's."""
    libraries = Path(ov.__file__).parent / "libs"
    found = [p.name for p in libraries.glob("*.so*") for name in (FUSION, "internal::MSDA")
             if name.encode() in p.read_bytes()]
    assert not found and VERSION.startswith("2026.4"), found


def test_patched_deformable_detr_onnx(record):
    row = Row("OpenVINO", VERSION, "deformable_detr", "ONNX, torch.onnx.export", "fp32", "batch")
    data = detector_graph("deformable_detr", None, result=row)
    with Timer(row):
        compiled = compile_openvino(ov.Core().read_model(data, b""))
    model = detector("deformable_detr")
    for batch in (1, 3):
        args = (images(batch, seed=batch),)
        check(row, run(compiled, args), eager(model, args), FP32, f"B{batch}")
    record(row)


def test_op_through_torch_export(record):
    row = Row("OpenVINO", VERSION, "op decoder", "aten (decomposition_table)", "fp32", "batch, queries")
    model = Attention(DECODER.levels)
    with Timer(row):
        program = decomposed(model, op_inputs(DECODER, 2, 40), small_dynamic_shapes())
        compiled = compile_openvino(ov.convert_model(program))
    for batch, queries in ((1, 7), (3, 45)):
        args = op_inputs(DECODER, batch, queries, seed=batch)
        check(row, run(compiled, args), eager(model, args), FP32, f"B{batch} Q{queries}")
    record(row)


def test_torchscript_route_meets_the_op():
    """ov.convert_model(module) traces with TorchScript, which records msda::deform_attn as one node: OpenVINO has
    no conversion for it. Export to ONNX or through torch.export (above) instead."""
    model = Attention(DECODER.levels)
    with pytest.raises(Exception, match="msda::deform_a"):
        ov.convert_model(model, example_input=op_inputs(DECODER, 2))


def test_torchscript_route_under_portable(record):
    """The one call that makes ov.convert_model(module) work: inside msda_core.export.portable() the trace records
    the gather arithmetic. TorchScript bakes the traced sizes in, so it runs at the traced shape."""
    row = Row("OpenVINO", VERSION, "op decoder", "convert_model(module) in portable()", "fp32", "none (traced)")
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2, 40, seed=4)
    with Timer(row), msda_core.export.portable():
        compiled = compile_openvino(ov.convert_model(model, example_input=args))
    check(row, run(compiled, args), eager(model, args), FP32)
    record(row)
