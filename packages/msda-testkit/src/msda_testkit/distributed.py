"""``torchrun --nproc-per-node 2 -m msda_testkit.distributed --backend gloo|nccl``: the op in data-parallel training.

Trains a few ``msda_core.nn.MSDeformAttn`` layers with a linear head (MSE loss) for a few SGD steps on every rank
(gloo: the CPU; nccl: ``cuda:{LOCAL_RANK}``) and checks, printing each check with its numbers:

1. devices: the op's output and the gradient it sends back lie on the rank's device, with that device current;
   on CUDA the op also gives the same bits when another GPU is the current device;
2. ``torch.use_deterministic_algorithms(True)``, the same data on every rank: each step's local gradients
   (captured in a DDP comm hook, before the all-reduce) and the parameters after the steps are bitwise identical
   across ranks;
3. different data per rank (default mode): the DDP gradient and parameters match one process trained on the
   concatenated batch, within the tolerance table's ``data_parallel`` entry;
4. FSDP2 (``fully_shard``) on the same data: its losses match DDP's within the ``sharded`` entry.

Exits 1 with the failed check on stderr. The test ``test_distributed`` runs it on gloo with two processes.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from msda_core.nn import MSDeformAttn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from . import cli
from .compare import compare
from .tolerances import tolerance

D_MODEL, HEADS, POINTS, LAYERS = 32, 2, 2, 2
LEVELS = ((8, 8), (4, 4))  # S = 80 tokens, each a query of the layer (an encoder)
BATCH = 2  # per rank, the same on all: DDP's mean of rank means is the batch mean (exactly, for 2^k ranks)
LR, STEPS = 0.1, 3  # the tolerance entries were derived for these


class CheckFailed(Exception):
    pass


class Net(nn.Module):
    """Residual MSDeformAttn encoder layers and a linear head: one number per token."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MSDeformAttn(D_MODEL, len(LEVELS), HEADS, POINTS) for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x, reference_points, shapes):
        for layer in self.layers:
            x = x + layer(x, reference_points, x, shapes)
        return self.head(x).squeeze(-1)


class DeviceProbe:
    """Hooks on every layer's ``output_proj`` (its input is the op's output) and ``value_proj`` (the gradient of
    its output is the op's grad_value): where each tensor lies and which CUDA device is current when it is made."""

    def __init__(self, model: Net):
        self.seen = []  # (what, tensor's device, current CUDA device index or None)
        for layer in model.layers:
            layer.output_proj.register_forward_pre_hook(lambda m, args: self._note("op output", args[0]))
            layer.value_proj.register_forward_hook(self._on_value)

    def _on_value(self, module, args, value):
        value.register_hook(lambda grad: self._note("op grad_value", grad))

    def _note(self, what, tensor):  # returns None: the hooks leave their tensors as they are
        current = torch.cuda.current_device() if tensor.is_cuda else None
        self.seen.append((what, tensor.device, current))

    def check(self, device: torch.device, label: str) -> str:
        wrong = [s for s in self.seen if s[1] != device or (device.type == "cuda" and s[2] != device.index)]
        kinds = {s[0] for s in self.seen}
        if wrong or kinds != {"op output", "op grad_value"}:
            raise CheckFailed(f"{label}: expected the op's forward and backward on {device} (current device "
                              f"{device.index}), saw {sorted(kinds)}; wrong: {wrong[:4]}")
        count = len(self.seen)
        self.seen.clear()
        return f"{count} op tensors on {device}"


def batch(world: int, rows: slice, device) -> tuple:
    """Rows of the global batch (world * BATCH samples, the same on every rank): inputs, reference points,
    targets. Every step trains on it again, so the loss falls by training alone."""
    g = torch.Generator().manual_seed(20)
    n, S = world * BATCH, sum(h * w for h, w in LEVELS)
    x = torch.randn(n, S, D_MODEL, generator=g)
    ref = torch.rand(n, S, len(LEVELS), 2, generator=g)
    target = torch.randn(n, S, generator=g)
    return tuple(t[rows].to(device) for t in (x, ref, target))


def new_model(device) -> Net:
    torch.manual_seed(0)  # every rank and the single-process reference start from the same weights
    return Net().to(device)


def train(model, params, data, shapes, after_backward=None) -> torch.Tensor:
    """STEPS SGD steps on one batch; the loss of each step (before its update)."""
    opt = torch.optim.SGD(params, lr=LR)
    x, ref, target = data
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x, ref, shapes), target)
        loss.backward()
        if after_backward:
            after_backward(step)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def gather(tensor: torch.Tensor) -> list:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def check_identical(label: str, per_rank: list) -> str:
    """Every rank's tensor bit for bit rank 0's."""
    differ = {r: int((t != per_rank[0]).sum()) for r, t in enumerate(per_rank) if not torch.equal(t, per_rank[0])}
    if differ:
        raise CheckFailed(f"{label}: not bitwise identical across ranks; elements differing from rank 0's: {differ}")
    return f"{label}: bitwise identical on {len(per_rank)} ranks ({per_rank[0].numel()} elements)"


def check_close(label: str, pairs: list, tol) -> str:
    """(name, actual, expected) triples within ``tol``; the worst as a fraction of its tensor's scale."""
    results = [compare(f"{label} {name}", actual, expected, tol) for name, actual, expected in pairs]
    failed = [str(r) for r in results if not r.passed]
    if failed:
        raise CheckFailed("; ".join(failed))
    worst, (name, *_) = max(zip(results, pairs), key=lambda rp: rp[0].max_rel_err)
    return (f"{label}: {len(results)} tensors within {tol.atol:g} of scale + {tol.rtol:g} x |expected|; worst "
            f"{name}: {worst.max_rel_err:.3g} of its scale")


def capture_local_grads(ddp: DDP) -> list:
    """Each bucket's gradients as this rank computed them, before the all-reduce averages them."""
    captured = []

    def hook(state, bucket):
        captured.append(bucket.buffer().clone())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    return captured


def ddp_of(model: Net, device) -> DDP:
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def devices_check(device, shapes) -> str:
    """On CUDA with several GPUs: the op run with another GPU current gives the same bits (it must launch on
    its tensors' device and that device's current stream). Deterministic mode, so the backward replays."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return "another current device: skipped (needs two CUDA devices)"
    x, ref, target = batch(1, slice(None), device)

    def run():
        model = new_model(device)
        out = model(x, ref, shapes)
        F.mse_loss(out, target).backward()
        return flat([out] + [p.grad for p in model.parameters()])

    expected = run()
    other = (device.index + 1) % torch.cuda.device_count()
    with torch.cuda.device(other):
        actual = run()
    torch.cuda.synchronize(device)
    if not torch.equal(actual, expected):
        raise CheckFailed(f"with cuda:{other} current, the op on {device} gave other results: "
                          f"{int((actual != expected).sum())} of {actual.numel()} elements differ")
    return f"with cuda:{other} current, forward and gradients on {device} bitwise as with {device} current"


def same_data(device, shapes) -> list:
    """Check 2: deterministic mode, every rank on the same rows."""
    world = dist.get_world_size()
    data = batch(world, slice(0, BATCH), device)
    model = new_model(device)
    probe = DeviceProbe(model)
    ddp = ddp_of(model, device)
    captured = capture_local_grads(ddp)
    local_grads = []

    n_params = sum(p.numel() for p in model.parameters())

    def after_backward(step):
        local_grads.append(flat(captured))
        captured.clear()
        if local_grads[-1].numel() != n_params:
            raise CheckFailed(f"same data: the comm hook saw {local_grads[-1].numel()} gradients of {n_params}")

    train(ddp, ddp.parameters(), data, shapes, after_backward)
    lines = [f"devices (DDP, deterministic): {probe.check(device, 'DDP, deterministic')}"]
    if flat(p.grad for p in model.parameters()).count_nonzero() == 0:
        raise CheckFailed("same data: the gradients are all zero: nothing was compared")
    for step, grads in enumerate(local_grads):
        lines.append(check_identical(f"same data: step {step} local gradients before all-reduce", gather(grads)))
    lines.append(check_identical(f"same data: parameters after {STEPS} steps",
                                 gather(flat(model.parameters()))))
    return lines


def different_data(device, shapes) -> tuple:
    """Check 3: default mode, rank r on rows [r*BATCH, (r+1)*BATCH); against one process on all the rows.
    Returns the lines and this rank's DDP losses (check 4 compares FSDP2's with them)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = batch(world, slice(rank * BATCH, (rank + 1) * BATCH), device)
    model = new_model(device)
    probe = DeviceProbe(model)
    ddp = ddp_of(model, device)
    captured = capture_local_grads(ddp)
    first = {}

    def after_backward(step):
        if step == 0:
            first["local"] = flat(captured)
            first["averaged"] = [p.grad.clone() for p in model.parameters()]
        captured.clear()

    losses = train(ddp, ddp.parameters(), data, shapes, after_backward)
    lines = [f"devices (DDP): {probe.check(device, 'DDP')}"]
    local = gather(first["local"])
    if any(torch.equal(t, local[0]) for t in local[1:]):
        raise CheckFailed("different data: two ranks' local gradients are equal: they were not captured before "
                          "the all-reduce, or the ranks did not get different rows")
    lines.append(f"different data: step 0 local gradients differ between the {world} ranks (captured before the "
                 f"all-reduce)" if world > 1 else "different data: one rank, so DDP's batch is the whole batch")

    reference = new_model(device)
    reference_grads = []

    def keep_first(step):
        if step == 0:
            reference_grads.extend(p.grad.clone() for p in reference.parameters())

    train(reference, reference.parameters(), batch(world, slice(None), device), shapes, keep_first)
    names = [n for n, _ in model.named_parameters()]
    tol = tolerance(torch.float32, "data_parallel")
    lines.append(check_close("different data vs one process: step 0 averaged gradient",
                             list(zip(names, first["averaged"], reference_grads)), tol))
    lines.append(check_close(f"different data vs one process: parameters after {STEPS} steps",
                             list(zip(names, model.parameters(), reference.parameters())), tol))
    return lines, losses


def fsdp2(device, shapes, ddp_losses) -> list:
    """Check 4: fully_shard on every layer and the root, the rows of check 3; its losses against DDP's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = batch(world, slice(rank * BATCH, (rank + 1) * BATCH), device)
    model = new_model(device)
    probe = DeviceProbe(model)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with warnings.catch_warnings():  # a Linear's output is a view; our residual adds are out of place, as asked
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        losses = train(model, model.parameters(), data, shapes)
    drop = (ddp_losses[0] - ddp_losses[-1]).item()
    return [f"devices (FSDP2): {probe.check(device, 'FSDP2')}",
            check_close(f"FSDP2 vs DDP (loss {ddp_losses[0].item():.4f} -> {ddp_losses[-1].item():.4f}, "
                        f"moved {drop:.3g})", [("losses", losses, ddp_losses)],
                        tolerance(torch.float32, "sharded"))]


def run_checks(device, say) -> None:
    """The four checks in order, each line passed to ``say`` as soon as it holds."""
    shapes = torch.tensor(LEVELS, dtype=torch.int64, device=device)
    torch.use_deterministic_algorithms(True)
    try:
        say([devices_check(device, shapes)])
        say(same_data(device, shapes))
    finally:
        torch.use_deterministic_algorithms(False)
    lines, ddp_losses = different_data(device, shapes)
    say(lines)
    say(fsdp2(device, shapes, ddp_losses))


def main(argv=None) -> int:
    parser = cli.parser("msda_testkit.distributed", __doc__)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: every rank on the CPU; nccl: rank on cuda:LOCAL_RANK")
    args = parser.parse_args(argv)
    # cuBLAS is deterministic only with a fixed workspace; it must be set before the first CUDA call
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(lines):
        if rank == 0:
            print("\n".join(f"  ok  {line}" for line in lines), flush=True)

    if rank == 0:
        print(f"msda_testkit.distributed: {world} ranks on {args.backend}, {STEPS} steps", flush=True)
    try:
        run_checks(device, say)
    except CheckFailed as err:
        print(f"msda_testkit.distributed: rank {rank}: FAILED: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("msda_testkit.distributed: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
