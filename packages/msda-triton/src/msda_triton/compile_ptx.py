"""``python -m msda_triton.compile_ptx``: compile every kernel variant for sm_80 and sm_90 with no GPU
(the forward under each of launch_config's rules x int32/int64 offsets and the backward x
native/fp32/fixed-point accumulation x its rules, x fp32/fp16/bf16, and the deterministic mode's two helper
kernels).

Fails on any compile error. Prints, for each backward variant, the atomic/reduction instructions its
grad_value scatter lowered to (``atom.*`` and ``red.*``): printed, not asserted, since a future Triton may
lower them differently. ``--sass`` adds the size of each loop in the machine code (BENCHMARKS.md counts the
forward's inner loops with it). Arguments carry the specialization the runtime would give the encoder call
(B2, Q = S = 22223, M 8, D 32, L 4, P 4): 16-byte-aligned pointers (as torch allocates) and 16-divisible
integers, so the PTX is the one that runs.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kernels

ARCHS = (80, 90)
INTS = {"n_rows": 2 * 22223 * 8, "Q": 22223, "S": 22223, "M": 8, "D": 32, "L": 4, "P": 4,
        "numel": 2 * 22223 * 8 * 32}
INDEX_POINTERS = ("shapes_ptr", "starts_ptr", "mass_ptr", "mass_max_ptr")
DTYPES = ("fp32", "fp16", "bf16")


RULES = {"many-rows": False, "few-rows": True}  # launch_config's few_rows
ACCUMULATORS = {"native": None, "fp32": "fp32", "fixed-point": "fp32"}  # grad_value's type (None: the dtype's)


def _variants():
    """(name, kernel, {pointer: type}, {constexpr: value}, num_warps) for every kernel x dtype x accumulation."""
    for dtype in DTYPES:
        for rule, few_rows in RULES.items():
            blocks, num_warps = kernels.launch_config(INTS["D"], backward=False, value_fp32=dtype == "fp32",
                                                      few_rows=few_rows)
            for width, wide in {"int32": False, "int64": True}.items():
                yield (f"forward {dtype} {rule} {width}", kernels.forward_kernel,
                       {"value_ptr": dtype, "loc_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype},
                       blocks | {"WIDE": wide}, num_warps)
        for (accum, accumulator), (rule, few_rows) in itertools.product(ACCUMULATORS.items(), RULES.items()):
            fixed_point = accum == "fixed-point"
            half_atomics = (accumulator or dtype) != "fp32"
            blocks, num_warps = kernels.launch_config(INTS["D"], backward=True, few_rows=few_rows,
                                                      half_atomics=half_atomics)
            pointers = {"value_ptr": dtype, "loc_ptr": dtype, "weight_ptr": dtype, "grad_out_ptr": dtype,
                        "grad_value_ptr": accumulator or dtype, "grad_loc_ptr": dtype, "grad_weight_ptr": dtype}
            helpers = ("fraction_ptr", "weight_max_ptr", "grad_max_ptr", "mass_max_ptr")
            if fixed_point:
                pointers |= {"fraction_ptr": "fp32", "weight_max_ptr": dtype, "grad_max_ptr": dtype}
            yield (f"backward {dtype} {accum} {rule}", kernels.backward_kernel, pointers,
                   blocks | {"FIXED_POINT": fixed_point}
                   | ({} if fixed_point else dict.fromkeys(helpers)), num_warps)
        yield (f"anchor mass {dtype}", kernels.anchor_mass_kernel,
               {"loc_ptr": dtype, "weight_ptr": dtype, "weight_max_ptr": dtype}, *kernels.ANCHOR_MASS_LAUNCH)
        yield (f"fixed-point finish {dtype}", kernels.fixed_point_finish_kernel,
               {"whole_ptr": "fp32", "fraction_ptr": "fp32", "weight_max_ptr": dtype, "grad_max_ptr": dtype,
                "out_ptr": dtype}, *kernels.FIXED_POINT_FINISH_LAUNCH)


def compile_variant(kernel, pointer_types: dict, constexprs: dict, num_warps: int, arch: int, asm: str = "ptx") -> str:
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INTS:
            signature[name] = "i32"
            if INTS[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "*i64" if name in INDEX_POINTERS else "*" + pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, **kernels.COMPILE_OPTIONS}  # as backend._launch passes them
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm[asm]


def loop_sizes(sass: str) -> list:
    """How many instructions each loop of a kernel's SASS (Triton's disassembly) holds: from a label to a later
    branch back to it. The inner loops of the issue-bound forward are where an instruction costs time."""
    labels, sizes, count = {}, [], 0
    for line in sass.splitlines():
        label = re.fullmatch(r"\s*(\w+):", line)
        if label:
            labels[label.group(1)] = count
        elif "\t" in line:  # an instruction, after its control code
            count += 1
            target = re.search(r"\bBRA\s+(\w+)", line)
            if target and count - labels.get(target.group(1), count) > 1:  # not the idle loop after EXIT
                sizes.append(count - labels[target.group(1)])
    return sizes


def atomic_instructions(ptx: str) -> str:
    found = Counter(re.findall(r"\b(?:atom|red)(?:\.[\w]+)+", ptx))
    return ", ".join(f"{op} x{n}" for op, n in sorted(found.items())) or "none"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m msda_triton.compile_ptx", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Compile every Triton kernel variant to PTX without a GPU and print the atomic and reduction "
                    "instructions of each; fails on any compile error.")
    parser.add_argument("--arch", type=int, nargs="+", choices=ARCHS, default=list(ARCHS),
                        help="compute capabilities to compile for, as 80 for sm_80")
    parser.add_argument("--sass", action="store_true",
                        help="also print how many SASS instructions each loop of each variant holds (disassembled "
                             "by the tools Triton ships)")
    args = parser.parse_args(argv)
    print(f"Triton {triton.__version__}; kernels compiled for " + ", ".join(f"sm_{a}" for a in args.arch))
    rows = []
    for name, kernel, pointer_types, constexprs, num_warps in _variants():
        for arch in args.arch:
            ptx = compile_variant(kernel, pointer_types, constexprs, num_warps, arch)
            found = atomic_instructions(ptx)
            if args.sass:
                loops = loop_sizes(compile_variant(kernel, pointer_types, constexprs, num_warps, arch, "sass"))
                found += f"; loops of {', '.join(map(str, loops))} instructions" if loops else "; no loops"
            rows.append((name, f"sm_{arch}", f"{len(ptx) // 1024} KiB", found))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'variant':{widths[0]}}  {'arch':{widths[1]}}  {'ptx':>{widths[2]}}  atomic / reduction instructions"
          + ("; SASS loop sizes" if args.sass else ""))
    for r in rows:
        print(f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    print(f"{len(rows)} variants compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
