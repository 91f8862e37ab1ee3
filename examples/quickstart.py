"""Multi-scale deformable attention on whatever msda backends are installed (CPU works with msda-reference)."""

import msda_core
import torch

levels = torch.tensor([(32, 48), (16, 24), (8, 12)])  # (H, W) of each pyramid level
B, Q, M, D, L, P = 2, 100, 8, 32, len(levels), 4
S = int((levels[:, 0] * levels[:, 1]).sum())
value = torch.randn(B, S, M, D)
locations = torch.rand(B, Q, M, L, P, 2)  # normalized (x, y) in [0, 1]
weights = torch.randn(B, Q, M, L * P).softmax(-1).view(B, Q, M, L, P)

out = torch.ops.msda.deform_attn(value, levels, None, locations, weights)  # None: level starts derived
print(f"output {tuple(out.shape)} {out.dtype} from backend {msda_core.resolve_backend(value, locations)!r}")
