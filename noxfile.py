"""Sessions: cpu (all tests runnable without a GPU; Triton kernels through its interpreter), compile_ptx
(every Triton kernel variant compiled for sm_80 and sm_90 without a GPU), gpu (the full suite on a CUDA
machine, offline, with that machine's torch and Triton), verify (the five-stage verification, on a GPU
machine like gpu), distributed (DDP and FSDP2 training with the op on two GPUs, NCCL), report (every backend
on every case, one table), bench (times of every backend: on a GPU machine run `python -m msda_testkit.bench`
there, it is offline).

MSDA_TORCH overrides the torch requirement (default torch==2.13.0, the CPU build on local disk here).
"""

import os
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["cpu", "compile_ptx"]

TORCH = os.environ.get("MSDA_TORCH", "torch==2.13.0")
PACKAGES = ("msda-core", "msda-reference", "msda-triton", "msda-testkit")
TEST_DIRS = [f"packages/{p}/tests" for p in PACKAGES]


def install_ours(session, *packages):
    """Our packages without their dependencies (installed explicitly), built with no network."""
    session.install("--no-build-isolation", "--no-deps", *[f"packages/{p}" for p in packages])


@nox.session
def cpu(session):
    session.install(TORCH, "setuptools>=70.1", "pytest", "tabulate", "numpy")
    # 1. The reference-only install: msda-core + msda-reference, no Triton, gives CPU inference.
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "triton", "msda-triton", "msda-testkit")
    install_ours(session, "msda-core", "msda-reference")
    session.run("python", "-c", "import importlib.util as u, sys; "
                "sys.exit('triton must be absent here' if u.find_spec('triton') else 0)")
    session.run("python", "examples/quickstart.py")
    # 2. Everything, the Triton kernels running in Triton's CPU interpreter.
    session.install("triton")
    install_ours(session, "msda-triton", "msda-testkit")
    session.run("pytest", "-q", *TEST_DIRS, *session.posargs, env={"TRITON_INTERPRET": "1"})
    # the CPU slice of the five-stage verification (stage 5 needs a GPU; sequential replays: 3 suffice)
    session.run("python", "-m", "msda_testkit.verify", "--device", "cpu", "--replays", "3",
                env={"TRITON_INTERPRET": "1"})


@nox.session
def compile_ptx(session):
    session.install("triton", "setuptools>=70.1")
    install_ours(session, "msda-triton")
    session.run("python", "-m", "msda_triton.compile_ptx", *session.posargs)


def install_private(session) -> dict:
    """For GPU machines: the python running nox, with that machine's own torch and Triton (no package
    registry needed); ours go to a private folder on PYTHONPATH, so nothing is installed into that
    environment. Returns the environment to run with."""
    site = os.path.join(session.create_tmp(), "site")
    session.run(sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--upgrade",
                "--target", site, *[f"packages/{p}" for p in PACKAGES], external=True)
    path = os.pathsep.join([site] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {"TRITON_INTERPRET": "0", "PYTHONPATH": path}


@nox.session(venv_backend="none")
def gpu(session):
    env = install_private(session)
    session.run(sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_DIRS, *session.posargs,
                env=env, external=True)


@nox.session(venv_backend="none")
def verify(session):
    """The five-stage verification of the Triton backend on a GPU machine (offline, as gpu)."""
    env = install_private(session)
    session.run(sys.executable, "-m", "msda_testkit.verify", *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def distributed(session):
    """The data-parallel checks (DDP, FSDP2) on two GPUs of one machine with NCCL, offline as gpu; ``nox -s cpu``
    runs them on gloo. Arguments go to torchrun: ``nox -s distributed -- --nproc-per-node 1`` on one GPU."""
    env = install_private(session)
    session.run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *session.posargs, "-m", "msda_testkit.distributed", "--backend", "nccl", env=env, external=True)


@nox.session
def report(session):
    session.install(TORCH, "setuptools>=70.1", "tabulate", "triton")
    install_ours(session, *PACKAGES)
    session.run("python", "-m", "msda_testkit.report", *session.posargs)


@nox.session
def bench(session):
    session.install(TORCH, "setuptools>=70.1", "tabulate", "triton", "matplotlib")
    install_ours(session, *PACKAGES)
    session.run("python", "-m", "msda_testkit.bench", *session.posargs)
    session.run("python", "-m", "msda_testkit.overhead", "--calls", "500")  # the host floor, from the same run


# PyPI's torchvision, which ultralytics needs, does not import beside torch 2.13.0: these two are a pair.
INTEGRATIONS_TORCH = ("torch==2.14.1", "torchvision==0.29.1")
INTEGRATIONS_LIBRARIES = ("transformers==5.24.0", "ultralytics==8.4.190")  # the versions integrations/ was read from


@nox.session
def integrations(session):
    """msda_core.patch on real transformers and ultralytics models, float64 on the CPU (integrations/); its GPU test
    skips without CUDA."""
    session.install(*INTEGRATIONS_TORCH)
    session.install(*INTEGRATIONS_LIBRARIES, "pytest", "tabulate", "setuptools>=70.1")
    install_ours(session, "msda-core", "msda-reference", "msda-testkit")
    session.run("pytest", "-q", "-rs", "integrations", *session.posargs)
