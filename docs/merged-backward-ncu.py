import sys
from dataclasses import replace

import msda_testkit as kit
import torch
from msda_triton import backend, kernels

backend.REPLAY_LAUNCHES = False
c = replace(kit.case("encoder_b2"), layout=sys.argv[1])
inp = kit.make_inputs(c, torch.float32, device="cuda")
value, shapes, starts, loc, w = (inp[k] for k in kit.ARGUMENTS)
go = kit.grad_output_for(inp)
gv = torch.zeros(value.shape, dtype=torch.float32, device="cuda")
gl, gw = torch.empty_like(loc), torch.empty_like(w)
for merge in (False, True):
    b, nw = kernels.launch_config(32, backward=True, merge=merge)
    if merge:
        b = dict(b, MERGE_PRECISION=sys.argv[2])
    for _ in range(2):
        backend.launch_backward(go, value, shapes, starts, loc, w, gv, gl, gw, config=(b, nw))
torch.cuda.synchronize()
