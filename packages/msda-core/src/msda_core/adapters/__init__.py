"""The adapters: the code that speaks other libraries' languages, apart from the op core above them.

- ``compat``: drop-in functions with the signatures existing code calls (Deformable DETR, mmcv, detrex,
  ultralytics, transformers, RF-DETR, RT-DETRv2 / D-FINE).
- ``shims``: stand-ins for the compiled extensions (``MultiScaleDeformableAttention``, ``mmcv._ext``, ...).
- ``nn``: the modules (Deformable DETR's ``MSDeformAttn``, transformers' parameter-free core).
- ``hub``: the layer Hugging Face's ``kernels`` swaps in.
- ``patching``: ``patch(model)``, which routes an existing model's attention through the drop-ins: ``forms``
  (recognising a family's function), ``replace`` (the counted, verified replacements), ``report``.
- ``onnx``: the export tables.

Everything here calls ``torch.ops.msda.deform_attn`` and nothing in the op core imports it. Users import these
as ``msda_core.compat``, ``msda_core.nn``, ``msda_core.hub`` and ``msda_core.onnx`` (msda_core registers those
names) and ``msda_core.patch``.
"""
