"""The README's three deploy routes on a small MSDeformAttn layer, on the CPU: torch.compile, an AOTInductor
package (loaded back in Python here; msda_testkit.deploy runs packages from C++) and ONNX run by onnxruntime
(pip install './packages/msda-core[onnx]'). Each prints its largest difference from eager, relative to the
output's largest magnitude. The program is exported with the batch and query counts dynamic, so the package serves
any of them. ``python examples/deploy.py [FOLDER]``: FOLDER keeps the package (attn.pt2); by default it is written
to a temporary folder, removed at the end."""

import sys
import tempfile
from pathlib import Path

import msda_core
import onnxruntime
import torch
from msda_core.nn import MSDeformAttn

torch.manual_seed(0)
levels = torch.tensor([(16, 24), (8, 12)])  # (H, W) of each level
attn = MSDeformAttn(d_model=64, n_levels=2, n_heads=4, n_points=2).eval()
query = torch.randn(2, 30, 64)
reference_points = torch.rand(2, 30, 2, 2)  # normalized (x, y) per level
features = torch.randn(2, int(levels.prod(1).sum()), 64)  # the flattened pyramid
args = (query, reference_points, features, levels)


def report(route, output):
    print(f"{route}: max |difference| / max |eager| = {((output - eager).abs().max() / eager.abs().max()).item():.2e}")


with torch.no_grad():
    eager = attn(*args)
    report("torch.compile", torch.compile(attn, fullgraph=True)(*args))

    with tempfile.TemporaryDirectory() as temporary:
        folder = sys.argv[1] if len(sys.argv) > 1 else temporary
        batch, queries = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("queries", min=1, max=4096)
        dynamic = ({0: batch, 1: queries}, {0: batch, 1: queries}, {0: batch}, None)  # one entry per argument
        program = torch.export.export(attn, args, dynamic_shapes=dynamic)
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(folder) / "attn.pt2"))
        report("AOTInductor", torch._inductor.aoti_load_package(package)(*args))

    onnx_program = torch.onnx.export(attn, args, dynamo=True,
                                     custom_translation_table=msda_core.onnx.translation_table())
    session = onnxruntime.InferenceSession(onnx_program.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    report("ONNX", torch.from_numpy(session.run(None, feeds)[0]))
