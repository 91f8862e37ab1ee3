"""Throwaway: the merged backward against the atomic one, kernel graph replays, one process."""
import json
import os
from dataclasses import replace

import msda_testkit as kit
import torch
import triton
import triton.testing
from msda_triton import backend, kernels

backend.REPLAY_LAUNCHES = False
out = []
orig_lc = kernels.launch_config
def gms(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as e:
        print("FAILED", repr(e)[:200], flush=True)
        return None
def cfg(merge, prec="tf32x3", form=0):
    b, w = orig_lc(32, backward=True, merge=merge)
    return (dict(b, MERGE_PRECISION=prec, MERGE_FORM=form) if merge else b), w
for batch, layout, dtype in [(2, "model_like", torch.float32), (2, "model_like", torch.bfloat16),
                             (2, "random", torch.float32), (2, "random", torch.bfloat16),
                             (2, "offmap", torch.float32), (2, "offmap", torch.bfloat16),
                             (8, "model_like", torch.float32), (8, "model_like", torch.bfloat16),
                             (8, "random", torch.float32), (8, "random", torch.bfloat16)]:
    c = replace(kit.case("encoder_b2"), batch=batch, layout="random" if layout == "offmap" else layout)
    inp = kit.make_inputs(c, dtype, device="cuda")
    if layout == "offmap":  # every corner off the map: the merge's arithmetic, no gathers, no atomics
        inp["sampling_locations"].fill_(-5.0)
    value, shapes, starts, loc, w = (inp[k] for k in kit.ARGUMENTS)
    go = kit.grad_output_for(inp)
    gv = torch.zeros(value.shape, dtype=torch.float32, device="cuda")
    gl, gw = torch.empty_like(loc), torch.empty_like(w)
    def kern(config):
        return lambda: backend.launch_backward(go, value, shapes, starts, loc, w, gv, gl, gw, config=config)
    row = {"B": batch, "layout": layout, "dtype": str(dtype)[6:]}
    gv.zero_(); kern(cfg(False))(); ref = gv.clone(); refgl = gl.clone()
    gv.zero_(); kern(cfg(True))(); torch.cuda.synchronize()
    row["err_tf32x3"] = (gv - ref).abs().max().item() / (ref.abs().max().item() or 1.0)
    row["gl_equal"] = bool(torch.equal(gl, refgl))
    row["atomic"] = gms(kern(cfg(False)))
    row["merged"] = gms(kern(cfg(True)))
    if batch == 2:
        row["merged_corner_tf32x3"] = gms(kern(cfg(True, "tf32x3", 1)))
        row["merged_corner_fma"] = gms(kern(cfg(True, "ieee", 2)))
        gv.zero_(); kern(cfg(True, "ieee", 2))(); torch.cuda.synchronize()
        row["err_corner_fma"] = (gv - ref).abs().max().item() / (ref.abs().max().item() or 1.0)
    if batch == 2 and dtype == torch.float32 and layout != "random":
        row["merged_ieee"] = gms(kern(cfg(True, "ieee")))
    if layout != "offmap":
        args = (go, value, shapes, starts, loc, w)
        row["bwd_default"] = gms(lambda: backend._backward(*args, "auto", False))
        row["bwd_determ"] = gms(lambda: backend._backward(*args, "auto", True))
        kernels.launch_config = lambda *a, **k: cfg(True) if k.get("backward") else orig_lc(*a, **k)
        try:
            row["bwd_determ_merged"] = gms(lambda: backend._backward(*args, "auto", True))
        finally:
            kernels.launch_config = orig_lc
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out.append(row)
    del inp, value, loc, w, go, gv, gl, gw, ref, refgl
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "merged.json"), "w"), indent=1)
