"""The adapters: the code that speaks other libraries' languages, apart from the op core above them.

- ``compat``: drop-in functions with the signatures existing code calls (Deformable DETR, mmcv, detrex,
  ultralytics, transformers, RF-DETR, RT-DETRv2 / D-FINE).
- ``shims``: stand-ins for the compiled extensions (``MultiScaleDeformableAttention``, ``mmcv._ext``, ...).
- ``nn``: the modules (Deformable DETR's ``MSDeformAttn``, transformers' parameter-free core).
- ``hub``: the layer Hugging Face's ``kernels`` swaps in.
- ``patching``: ``patch(model)``, which routes an existing model's attention through the drop-ins: ``forms``
  (recognising a family's function), ``replace`` (the counted, verified replacements), ``report``.
- ``onnx``: the ONNX graph forms, for both of torch's exporters.
- ``export``: the op as plain aten ops, for torch.export consumers (and the dynamo ONNX exporter without a table).

Everything here calls ``torch.ops.msda.deform_attn``; the op core imports none of it. ``export`` sets the op's one
hook, ``msda_core.op.export_time_forward``: while one of torch's ONNX exporters runs, the op computes as ``export``'s
decomposition and ``onnx``'s symbolic is registered. Users import
these as ``msda_core.compat``, ``msda_core.nn``, ``msda_core.hub``, ``msda_core.onnx`` and ``msda_core.export``
(msda_core registers those names) and ``msda_core.patch``.
"""
