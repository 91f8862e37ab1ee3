"""msda as a layer for Hugging Face's ``kernels`` package, in place of transformers' ``MultiScaleDeformableAttention``.

transformers 5.x decorates its parameter-free ``MultiScaleDeformableAttention`` with
``use_kernel_forward_from_hub("MultiScaleDeformableAttention")``, and ``kernels.kernelize`` swaps in, per module, the
forward of the layer a kernel mapping names for that layer name. kernels accepts only a stateless layer (no
``__init__``, no members of its own), so this one holds nothing: the backend is chosen as for any call
(``use_backend``, ``MSDA_BACKEND``). ``mapping()`` registers it from this process, with no hub access::

    from kernels import Mode, kernelize, use_kernel_mapping
    with use_kernel_mapping(msda_core.hub.mapping()):
        model = kernelize(model, mode=Mode.TRAINING, device="cuda")

This module imports torch only; the caller imports kernels.
"""

from __future__ import annotations

import torch

from .compat import run_op

LAYER_NAME = "MultiScaleDeformableAttention"  # transformers' hub layer name


class MultiScaleDeformableAttention(torch.nn.Module):
    """The stateless layer ``kernels.kernelize`` swaps in: transformers' forward signature, run by
    ``torch.ops.msda.deform_attn``.

    kernels copies only this class's ``forward`` onto transformers' module, and accepts no ``__init__`` or
    members of its own, so it holds nothing: the backend comes from :func:`msda_core.use_backend` or
    ``MSDA_BACKEND``, and no calls are counted. ``msda_core.nn.MultiScaleDeformableAttention`` is the other
    route, the module ``msda_core.patch`` puts in place, with a ``backend`` of its own and a call count.

    Example:
        >>> import torch
        >>> from msda_core.hub import MultiScaleDeformableAttention
        >>> shapes = torch.tensor([(4, 6), (2, 3)])
        >>> value, locations = torch.randn(1, 30, 2, 8), torch.rand(1, 5, 2, 2, 3, 2)
        >>> out = MultiScaleDeformableAttention()(value, shapes, [(4, 6), (2, 3)], None, locations,
        ...                                       torch.rand(1, 5, 2, 2, 3), 64)
        >>> out.shape
        torch.Size([1, 5, 16])
    """

    can_torch_compile = True  # kernels' flags: the op compiles, and has its own backward
    has_backward = True

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step):
        """transformers' forward: the op on these tensors; ``im2col_step`` is ignored. Arguments, result and
        errors as ``msda_core.nn.MultiScaleDeformableAttention.forward``."""
        shapes = value_spatial_shapes if value_spatial_shapes is not None else value_spatial_shapes_list
        return run_op(value, shapes, level_start_index, sampling_locations, attention_weights)


class Repository:
    """A repository as kernels' mapping takes one (``load()`` returns the layer class), local to this process."""

    layer_name = LAYER_NAME

    def load(self) -> type:
        return MultiScaleDeformableAttention

    def __eq__(self, other) -> bool:  # kernels memoizes loaded layers by repository, and copies its mappings
        return isinstance(other, Repository)

    def __hash__(self) -> int:
        return hash(Repository)

    def __str__(self) -> str:
        return "msda_core.hub.Repository"


def mapping(devices=("cpu", "cuda")) -> dict:
    """A kernel mapping for ``kernels.use_kernel_mapping`` (or ``register_kernel_mapping``): transformers' layer
    name to this module's layer on each device type, in every mode. No hub access; kernels is not imported.

    Args:
        devices: the device types (``"cpu"``, ``"cuda"``) on which kernelize should swap in msda: several, or one
            as a string.

    Returns:
        ``{"MultiScaleDeformableAttention": {device: Repository()}}``; a Repository's ``load()`` is the layer.

    Raises:
        TypeError: a device type that is not a string.

    Example:
        >>> import msda_core
        >>> table = msda_core.hub.mapping()
        >>> sorted(table["MultiScaleDeformableAttention"])
        ['cpu', 'cuda']
        >>> list(msda_core.hub.mapping("cpu")["MultiScaleDeformableAttention"])
        ['cpu']
        >>> table["MultiScaleDeformableAttention"]["cpu"].load() is msda_core.hub.MultiScaleDeformableAttention
        True

        With kernels installed and a transformers model whose ``MultiScaleDeformableAttention`` it decorates::

            from kernels import Mode, kernelize, use_kernel_mapping
            with use_kernel_mapping(msda_core.hub.mapping()):
                model = kernelize(model, mode=Mode.TRAINING, device="cuda")
    """
    if isinstance(devices, str):  # one device type, not its letters
        devices = (devices,)
    for device in devices:
        if not isinstance(device, str):
            raise TypeError(f"devices: expected device type names such as 'cpu' or 'cuda', got {device!r}")
    return {LAYER_NAME: {device: Repository() for device in devices}}
