"""Valid tiny inputs for the validation and registry tests: the anchors' levels, every size a keyword a test can
change, any dtype (the testkit's cases, which the other tests use, come in fixed shapes)."""

import torch


def tiny_inputs(dtype=torch.float64, B=1, Q=2, M=2, D=3, levels=((6, 4), (3, 2)), P=2):
    g = torch.Generator().manual_seed(0)
    L, S = len(levels), sum(h * w for h, w in levels)
    starts = [0]
    for h, w in levels[:-1]:
        starts.append(starts[-1] + h * w)
    return {
        "value": torch.randn(B, S, M, D, generator=g, dtype=torch.float64).to(dtype),
        "spatial_shapes": torch.tensor(levels, dtype=torch.int64),
        "level_start_index": torch.tensor(starts, dtype=torch.int64),
        "sampling_locations": torch.rand(B, Q, M, L, P, 2, generator=g, dtype=torch.float64).to(dtype),
        "attention_weights": torch.rand(B, Q, M, L, P, generator=g, dtype=torch.float64).to(dtype),
    }

