"""What the deploy tests share: the models (the op alone at an encoder-like and a decoder-like shape, tiny patched
transformers detectors), their inputs and eager outputs, the ONNX exports (cached on disk, one per key, for every
pytest-xdist worker), the check against the eager output, and the row each check adds to the results table.

Every runtime is held to the eager output of the same patched model on the same inputs, in float32, within the
testkit's tolerance entry named at the check (msda_testkit.tolerances gives the reason beside each number)."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import msda_core
import msda_testkit as kit
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integrations"))  # the tiny models' configs
from equivalence import randomize  # noqa: E402
from test_transformers import DETR, IMAGE_SIZE, RT_DETR  # noqa: E402

CACHE = Path(os.environ.get("MSDA_DEPLOY_CACHE", Path(tempfile.gettempdir()) / "msda-deploy"))
OPSETS = (16, 17, 18, 19, 20)  # GridSample (the grid_sample form) first appears in 16; 20 is TensorRT 10's newest
STANDARD_FORMS = ("gather", "grid_sample")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The op's sizes: a level table, heads M, head dim D, points P and the query count Q at export."""

    name: str
    levels: tuple
    queries: int
    heads: int = 2
    dim: int = 8
    points: int = 4

    @property
    def pixels(self) -> int:
        return sum(h * w for h, w in self.levels)


LEVELS = ((10, 16), (5, 8), (3, 4))  # H != W on every level, so a swapped H and W would show
ENCODER = Shape("encoder", LEVELS, queries=sum(h * w for h, w in LEVELS))  # a query per pixel
DECODER = Shape("decoder", LEVELS, queries=30, points=2)


class Attention(torch.nn.Module):
    """The op alone as a model calls it: the level table a constant of the model (models build it from the feature
    maps' static sizes), value, locations and weights inputs."""

    def __init__(self, levels):
        super().__init__()
        self.register_buffer("spatial_shapes", torch.tensor(levels))

    def forward(self, value, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, self.spatial_shapes, None, sampling_locations, attention_weights)


def op_inputs(shape: Shape, batch: int, queries: int | None = None, dtype=torch.float32, seed: int = 0) -> tuple:
    """value (B, S, M, D), locations (B, Q, M, L, P, 2) with about a sixth of them off the maps, softmax weights."""
    g = torch.Generator().manual_seed(seed)
    Q, L = queries or shape.queries, len(shape.levels)
    value = torch.randn(batch, shape.pixels, shape.heads, shape.dim, generator=g)
    locations = torch.rand(batch, Q, shape.heads, L, shape.points, 2, generator=g) * 1.2 - 0.1
    weights = torch.randn(batch, Q, shape.heads, L * shape.points, generator=g).softmax(-1)
    return tuple(x.to(dtype) for x in (value, locations, weights.view(batch, Q, shape.heads, L, shape.points)))


def op_dynamic_shapes() -> tuple:
    """Batch and queries dynamic: value's dim 0, the locations' and weights' dims 0 and 1."""
    batch, queries = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("queries", min=1, max=4096)
    return {0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries}


class Outputs(torch.nn.Module):
    """A transformers detector's decoder and encoder outputs as a tuple: what an exported graph returns, in order."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state, out.encoder_last_hidden_state


def detector(name: str) -> torch.nn.Module:
    """A tiny transformers model with random weights that move samples off the knots and the maps, patched."""
    import transformers as T

    torch.manual_seed(0)  # what randomize leaves (embeddings, norms) is the same in every process
    if name == "deformable_detr":
        model = T.DeformableDetrModel(T.DeformableDetrConfig(**DETR, use_timm_backbone=False))
    elif name == "rt_detr_v2":
        model = T.RTDetrV2Model(T.RTDetrV2Config(**RT_DETR))
    else:
        raise ValueError(f"name: expected 'deformable_detr' or 'rt_detr_v2', got {name!r}")
    model.eval()
    randomize(model)
    report = msda_core.patch(model)
    assert report.patched, str(report)
    return Outputs(model)


def images(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def eager(model: torch.nn.Module, args: tuple) -> list:
    """The model's outputs on args as a flat list of tensors, in the order an exported graph returns them."""
    with torch.no_grad():
        return flat(model(*args))


def flat(out) -> list:
    return [t for item in out for t in flat(item)] if isinstance(out, (tuple, list)) else [out]


@dataclasses.dataclass
class Row:
    """One line of the closing table: a runtime, how the graph was made, and its worst error against eager."""

    runtime: str
    version: str
    model: str
    form: str
    dtype: str
    dynamic: str
    worst: float = 0.0
    convert_s: float = 0.0


def compile_openvino(model):
    """An OpenVINO model (or a file of one) compiled for the CPU in fp32: on a CPU with bf16 arithmetic the plugin's
    default precision is bf16, which put the tiny Deformable DETR's output 1.4% of its scale off (the convolutions
    and matmuls; the op's graph alone stays fp32)."""
    import openvino as ov

    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def version(distribution: str) -> str:
    """The installed release of a package, for the results table."""
    return importlib.metadata.version(distribution)


def check(row: Row, outputs, expected, tol: kit.Tolerance, label: str = "") -> float:
    """Each runtime output within ``tol`` of the eager one (kit.compare: atol relative to the tensor's scale);
    the row keeps the worst error relative to the scale. Returns that worst error."""
    outputs = [torch.as_tensor(o) for o in outputs]
    assert len(outputs) == len(expected), f"{len(outputs)} outputs, expected {len(expected)}"
    for i, (got, want) in enumerate(zip(outputs, expected)):
        result = kit.compare(f"{row.runtime} {row.model} {row.form} {label} output {i}", got, want, tol)
        row.worst = max(row.worst, result.max_rel_err)
        assert result.passed, str(result)
    return row.worst


class Timer:
    """``with Timer(row):`` adds the block's wall time to the row's conversion time."""

    def __init__(self, row: Row):
        self.row = row

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.row.convert_s += time.perf_counter() - self.start


def cached(key: str, build, row: Row | None = None) -> bytes:
    """``build()``'s bytes, made once per key and kept on disk (CACHE) for every worker and later runs of the same
    code (torch's, onnxscript's and msda's versions and sources are in the key): a worker that asks while another
    builds waits for it instead of building too. The time the build took is kept beside it and added to ``row``'s
    conversion time."""
    import onnxscript

    versions = f"{torch.__version__} {onnxscript.__version__} {_source_digest()}"
    path = CACHE / f"{hashlib.sha256(f'{key} {versions}'.encode()).hexdigest()[:24]}.bin"
    seconds = path.with_suffix(".seconds")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path.exists() and seconds.exists()):
            start = time.perf_counter()
            path.write_bytes(build())
            seconds.write_text(str(time.perf_counter() - start))
    if row is not None:
        row.convert_s += float(seconds.read_text())
    return path.read_bytes()


@functools.cache
def _source_digest() -> str:
    """msda-core's sources and this folder's, so an edited form or test export is not taken from the cache."""
    digest = hashlib.sha256()
    roots = (Path(msda_core.__file__).parent, Path(__file__).parent)
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def onnx_export(model, args, form: str | None, opset: int = 18, dynamic_shapes=None, dynamo: bool = True) -> bytes:
    """The model as ONNX bytes. ``form`` None: torch's exporter as a user calls it, with no msda argument (the
    dynamo exporter, or with ``dynamo=False`` the TorchScript one); else the dynamo exporter with
    ``msda_core.onnx.translation_table(form)``."""
    if not dynamo:
        buffer = io.BytesIO()
        names = [f"input{i}" for i in range(len(args))]
        axes = {name: axes for name, axes in zip(names, dynamic_shapes or ())}
        torch.onnx.export(model, args, buffer, dynamo=False, opset_version=opset, input_names=names,
                          dynamic_axes=axes or None)
        return buffer.getvalue()
    table = None if form is None else msda_core.onnx.translation_table(form)
    program = torch.onnx.export(model, args, dynamo=True, verbose=False, opset_version=opset,
                                dynamic_shapes=dynamic_shapes, custom_translation_table=table)
    return program.model_proto.SerializeToString()


def op_graph(shape, form, version=18, dtype=torch.float32, row=None) -> bytes:
    """The op alone exported with batch and queries dynamic (cached: OpenVINO's and TensorRT's tests read the
    same graphs)."""
    model = Attention(shape.levels)
    return cached(f"op {shape} {form} {version} {dtype}",
                  lambda: onnx_export(model, op_inputs(shape, 2, dtype=dtype), form, version, op_dynamic_shapes()), row)


def detector_graph(name, form, dynamo=True, result=None) -> bytes:
    """A tiny patched detector exported at batch 2 with the batch dynamic: with msda's table for ``form``, or with
    torch's exporter and no msda argument (form None; ``dynamo=False``: the TorchScript exporter)."""
    dims = ({0: torch.export.Dim("batch", min=1, max=8)},) if dynamo else ({0: "batch"},)
    return cached(f"detector {name} {form} {dynamo}",
                  lambda: onnx_export(detector(name), (images(2),), form, dynamic_shapes=dims, dynamo=dynamo), result)


def op_types(model_bytes: bytes) -> set:
    """Every node's op type in an ONNX model, its functions' included."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    graphs = [model.graph, *model.functions]
    return {node.op_type for graph in graphs for node in graph.node}


def opset(model_bytes: bytes) -> int:
    import onnx

    model = onnx.load_from_string(model_bytes)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def decomposed(model, args, dynamic_shapes=None):
    """``torch.export`` of the model, then msda's decomposition table: a program of core aten ops, no msda op (what
    ExecuTorch, LiteRT, coremltools and OpenVINO's torch.export route take)."""
    program = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    program = program.run_decompositions(msda_core.export.decomposition_table())
    assert not [n for n in program.graph.nodes if "msda" in str(n.target)]
    return program


def nudge_program(program, old: float, new: float):
    """The program with every float argument ``old`` of its aten calls set to ``new`` (in place; returned): a
    number a conversion could change without anything else showing. The gather arithmetic's only 0.5 is the
    half-pixel offset of ``x = loc * W - 0.5``."""
    changed = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and old in [a for a in node.args if isinstance(a, float)]:
            node.args = tuple(new if isinstance(a, float) and a == old else a for a in node.args)
            changed += 1
    assert changed, f"no argument {old} in the program"
    program.graph_module.recompile()
    return program


def small_dynamic_shapes() -> tuple:
    """Batch up to 4 and queries up to 64, dynamic: the sizes ExecuTorch's memory plan and LiteRT allow for."""
    batch, queries = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("queries", min=1, max=64)
    return {0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries}
