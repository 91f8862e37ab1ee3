"""Modules: Deformable DETR's ``MSDeformAttn`` and transformers' parameter-free core, both running msda."""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import registry, validation
from .compat import level_shapes, run_op


class MSDeformAttn(nn.Module):
    """Deformable DETR's multi-scale deformable attention module, run by ``torch.ops.msda.deform_attn``.

    The same constructor, forward, ``_reset_parameters`` and parameter names (``sampling_offsets``,
    ``attention_weights``, ``value_proj``, ``output_proj``) as ``models.ops.modules.MSDeformAttn``, so its
    checkpoints (and Mask2Former's, DINO's) load with ``strict=True`` and give the same outputs. No power-of-two
    head-dim warning: msda's kernels take any head dim.

    Args:
        d_model: channels of the query and of the input, a multiple of ``n_heads``.
        n_levels: levels of the feature pyramid (L).
        n_heads: attention heads (M); each has ``d_model // n_heads`` channels (D).
        n_points: samples per head per level (P).
        backend: ``"auto"`` or a backend's name, given to the op on every call.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size below 1, ``d_model`` not a multiple of ``n_heads``, or an unknown ``backend``.

    Example:
        >>> import torch
        >>> from msda_core.nn import MSDeformAttn
        >>> attn = MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
        >>> shapes = torch.tensor([(4, 6), (2, 3)])        # (H, W) per level: S = 30
        >>> query, reference = torch.randn(1, 5, 32), torch.rand(1, 5, 2, 2)
        >>> attn(query, reference, torch.randn(1, 30, 32), shapes).shape
        torch.Size([1, 5, 32])
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4, *,
                 backend: str = "auto"):
        super().__init__()
        for arg, size in (("d_model", d_model), ("n_levels", n_levels), ("n_heads", n_heads), ("n_points", n_points)):
            if not isinstance(size, int) or isinstance(size, bool):
                raise TypeError(f"{arg}: expected a positive int, got {size!r}")
            if size < 1:
                raise ValueError(f"{arg}: expected a positive int, got {size!r}")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model: expected a multiple of n_heads = {n_heads}, got {d_model}")
        registry.check_name(backend)
        self.im2col_step = 64  # read by code written for the CUDA extension; msda ignores it
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.backend = backend
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self):
        """Deformable DETR's initialisation: offsets start on a ring, head m pointing at angle 2*pi*m/M scaled so
        its larger coordinate is 1, point p at (p + 1) times that; uniform attention; xavier projections."""
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        thetas = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid = grid / grid.abs().max(-1, keepdim=True).values
        grid = grid.view(self.n_heads, 1, 1, 2).repeat(1, self.n_levels, self.n_points, 1)
        grid = grid * torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index=None,
                input_padding_mask=None):
        """Attend from each query to ``n_points`` samples per head and level around its reference point.

        Args:
            query: (N, Len_q, d_model) float tensor.
            reference_points: (N, Len_q, n_levels or 1, 2) normalized (x, y), offsets then in pixels of each
                level; or (..., 4) boxes (cx, cy, w, h), offsets in units of half the box per point.
            input_flatten: (N, S, d_model), the levels flattened and concatenated as the op's ``value``.
            input_spatial_shapes: (n_levels, 2) int tensor or list of (H, W).
            input_level_start_index: (n_levels,) int tensor, or None to derive it.
            input_padding_mask: (N, S) bool, True at padding (those pixels read as 0), or None.

        Returns:
            (N, Len_q, d_model) in the query's dtype.

        Raises:
            ValueError: a shape that does not fit ``d_model``, ``n_levels`` or the other arguments, naming the
                argument; and whatever :func:`msda_core.deform_attn` raises.
        """
        tensors = {"query": query, "reference_points": reference_points, "input_flatten": input_flatten,
                   "input_spatial_shapes": input_spatial_shapes, "input_level_start_index": input_level_start_index,
                   "input_padding_mask": input_padding_mask}
        for arg, x in tensors.items():
            if x is not None and (arg != "input_spatial_shapes" or isinstance(x, torch.Tensor)):  # or a list
                validation.check_tensor(arg, x)
                validation.check_device(arg, x, query.device, "query")
        if query.dim() != 3 or query.shape[2] != self.d_model:
            raise ValueError(f"query: expected shape (N, Len_q, d_model) with d_model = {self.d_model}, got "
                             f"{tuple(query.shape)}")
        N, Len_q = query.shape[:2]
        if input_flatten.dim() != 3:
            raise ValueError(f"input_flatten: expected shape (N, S, d_model), got {tuple(input_flatten.shape)}")
        S = input_flatten.shape[1]
        M, L, P = self.n_heads, self.n_levels, self.n_points
        _check_shape("input_flatten", input_flatten, "(N, S, d_model)", (N, S, self.d_model))
        if (reference_points.dim() != 4 or tuple(reference_points.shape[:2]) != (N, Len_q)
                or reference_points.shape[2] not in (L, 1) or reference_points.shape[3] not in (2, 4)):
            raise ValueError(f"reference_points: expected shape (N, Len_q, L or 1, 2 or 4) with (N, Len_q, L) = "
                             f"{(N, Len_q, L)}, got {tuple(reference_points.shape)}")
        shapes = level_shapes(input_spatial_shapes, query.device, "input_spatial_shapes")
        if tuple(shapes.shape) != (L, 2):
            raise ValueError(f"input_spatial_shapes: expected (H, W) of n_levels = {L} levels, got shape "
                             f"{tuple(shapes.shape)}")

        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            _check_shape("input_padding_mask", input_padding_mask, "(N, S)", (N, S))
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, S, M, self.d_model // M)
        offsets = self.sampling_offsets(query).view(N, Len_q, M, L, P, 2)
        weights = self.attention_weights(query).view(N, Len_q, M, L * P).softmax(-1).view(N, Len_q, M, L, P)
        reference = reference_points[:, :, None, :, None, :]
        if reference_points.shape[-1] == 2:  # offsets are in pixels of each level
            normalizer = torch.stack([shapes[:, 1], shapes[:, 0]], -1).to(offsets.dtype)  # (W, H)
            locations = reference + offsets / normalizer[None, None, None, :, None, :]
        else:  # offsets are in units of the box's half size, per point
            locations = reference[..., :2] + offsets / P * reference[..., 2:] * 0.5
        output = run_op(value, shapes, input_level_start_index, locations, weights, backend=self.backend)
        return self.output_proj(output)


def _check_shape(arg, tensor, names, expected):
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{arg}: expected shape {names} = {tuple(expected)}, got {tuple(tensor.shape)}")


class MultiScaleDeformableAttention(nn.Module):
    """transformers' parameter-free ``MultiScaleDeformableAttention`` core, run by ``torch.ops.msda.deform_attn``.

    ``msda_core.patch`` puts one in place of each such child of a transformers model (ten detector families).
    It has state: the ``backend`` given here, and ``calls``, the count of eager forwards, so a caller can see that
    msda ran (calls inside torch.compile'd code are not counted: a counter dynamo saw changing would recompile
    the graph on every call). ``msda_core.hub.MultiScaleDeformableAttention`` is the other route, for
    ``kernels.kernelize``, which accepts only a layer with no state: it has neither.

    Args:
        backend: ``"auto"`` or a backend's name, given to the op on every call.

    Raises:
        ValueError: an unknown ``backend``.

    Example:
        >>> import torch
        >>> from msda_core.nn import MultiScaleDeformableAttention
        >>> core = MultiScaleDeformableAttention()
        >>> shapes = torch.tensor([(4, 6), (2, 3)])
        >>> value, locations = torch.randn(1, 30, 2, 8), torch.rand(1, 5, 2, 2, 3, 2)
        >>> out = core(value, shapes, [(4, 6), (2, 3)], None, locations, torch.rand(1, 5, 2, 2, 3))
        >>> out.shape, core.calls
        (torch.Size([1, 5, 16]), 1)
    """

    def __init__(self, backend: str = "auto"):
        super().__init__()
        registry.check_name(backend)
        self.backend = backend
        self.calls = 0

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step=None):
        """transformers' forward: the op on these tensors; ``im2col_step`` is ignored.

        Args:
            value: (B, S, M, D); value_spatial_shapes: (L, 2) int tensor, used when given (it is on the device);
            value_spatial_shapes_list: the same as a list of (H, W), used only when the tensor is None;
            level_start_index: (L,) or None; sampling_locations: (B, Q, M, L, P, 2), or (B, Q, M, L*P, 2)
            level-major; attention_weights: (B, Q, M, L, P) or (B, Q, M, L*P). Floating dtypes: locations and
            weights are cast to a pair the op takes (value's dtype, or float32 beside a half value). One device.

        Returns:
            (B, Q, M*D) in value's dtype.

        Raises:
            what :func:`msda_core.deform_attn` raises.
        """
        if not torch.compiler.is_compiling():
            self.calls += 1
        shapes = value_spatial_shapes if value_spatial_shapes is not None else value_spatial_shapes_list
        return run_op(value, shapes, level_start_index, sampling_locations, attention_weights,
                           backend=self.backend)
