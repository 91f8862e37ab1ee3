"""A tiny transformers Deformable DETR, patched to msda, exported to ONNX with msda_core.onnx's translation table (the
default gather form: no GridSample) and run in onnxruntime on the CPU: it matches the patched model's eager outputs,
at the exported batch and another (the batch is dynamic), with its sampling locations partly off the maps. Both
forms at the op's level: msda-reference's test_onnx.py."""

import msda_core
import msda_core.onnx
import msda_testkit as kit
import pytest
import torch
import transformers as T
from equivalence import randomize
from test_transformers import DETR, IMAGE_SIZE

onnxruntime = pytest.importorskip("onnxruntime")


def _images(batch, seed):
    return torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


class Outputs(torch.nn.Module):
    """The model's decoder and encoder outputs as a tuple: what the exported graph returns, in order."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state, out.encoder_last_hidden_state


def test_patched_deformable_detr_runs_in_onnxruntime():
    detr = T.DeformableDetrModel(T.DeformableDetrConfig(**DETR, use_timm_backbone=False)).eval()
    randomize(detr)  # offsets of +-1.5 px on 8x8..2x2 maps: samples off the maps too
    report = msda_core.patch(detr)
    assert report.patched, str(report)
    model = Outputs(detr)
    images = _images(2, seed=0)
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.onnx.export(model, (images,), dynamo=True, verbose=False, dynamic_shapes=({0: batch},),
                                custom_translation_table=msda_core.onnx.translation_table())
    assert "GridSample" not in {node.op_type for node in program.model.graph}
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    for pixels in (images, _images(3, seed=1)):
        with torch.no_grad():
            expected = model(pixels)
        for output, got, want in zip(("decoder", "encoder"), session.run(None, {name: pixels.numpy()}), expected):
            kit.assert_close(output, torch.from_numpy(got), want, kit.tolerance(torch.float32, "forward"))
