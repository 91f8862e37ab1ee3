"""transformers' own kernel route: ``kernels.kernelize`` with msda_core.hub's mapping swaps msda's stateless layer
into a tiny Deformable DETR's ``MultiScaleDeformableAttention`` modules, inference and training; outputs and every
parameter gradient must equal the unkernelized model's in float64 (equivalence.py's tolerances), every module's
call counted. transformers' hub decorator is live only for the kernels versions that transformers release
accepts: the session runs this file with transformers 5.22.2 and kernels 0.17.2 (the newest kernels on PyPI
here; transformers 5.23 and later ask for kernels >= 0.18.2), and it skips beside any other pair."""

import copy

import msda_core.hub
import msda_testkit as kit
import pytest
import transformers as T
from equivalence import OUTPUT, Recording, Result, _gradient_error, forward_backward, randomize
from test_transformers import DETR, _image
from transformers.utils.import_utils import is_kernels_available

kernels = pytest.importorskip("kernels")
pytestmark = pytest.mark.skipif(not is_kernels_available(), reason=(
    f"transformers {T.__version__} does not accept kernels {kernels.__version__}: its hub decorator is inert"))


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_kernelize_swaps_in_msda(mode, record):
    model = T.DeformableDetrModel(T.DeformableDetrConfig(**DETR)).double().eval()
    randomize(model)
    inputs = {"pixel_values": _image().double()}
    expected, expected_grads = forward_backward(model, inputs)
    cores = [m for m in model.modules() if type(m).__name__ == msda_core.hub.LAYER_NAME]
    assert cores and all(type(m).kernel_layer_name == msda_core.hub.LAYER_NAME for m in cores)
    kernelized = copy.deepcopy(model)
    with kernels.use_kernel_mapping(msda_core.hub.mapping()):
        kernels.kernelize(kernelized, mode=getattr(kernels.Mode, mode), device="cpu", use_fallback=False)
    with Recording() as recording, msda_core.use_backend(recording.name):
        outputs, grads = forward_backward(kernelized, inputs)
    assert recording.calls == len(cores) and recording.backward_calls == len(cores)
    output_error = max(kit.assert_close(f"output {i}", a, e, OUTPUT).max_rel_err
                       for i, (a, e) in enumerate(zip(outputs, expected, strict=True)))
    record(f"kernels {mode.lower()}", Result(["kernelize"], output_error, _gradient_error(grads, expected_grads),
                                             recording.calls, recording.min_knot_distance, "-"))
