"""Sessions. CI (.ci/run) runs lint, packages, cpu, compile_ptx and integrations (which runs deploy's tests too);
the rest need a GPU machine or an explicit call.

- lint: ruff on the whole tree (ruff.toml); no two packages' test files share a name.
- packages: each package built as a wheel; every sibling range one declares admits the sibling's version.
- cpu: each package installed from its wheel with its declared dependencies (its [test] extra included) and its
  own tests run (first, mypy on msda-core and msda-reference: mypy.ini, against the session's torch):
  msda-core, msda-reference, msda-testkit and msda-benchmarks (the tools) with no Triton (the
  reference-only install runs the quickstart; then the docstrings' examples, as doctests), then msda-triton, its
  kernels in Triton's CPU interpreter, and the verification's CPU slice.
  Last, every Triton kernel variant compiled for sm_80 and sm_90 with no GPU on the newest Triton (the one
  installed here).
- compile_ptx: the same on the lowest Triton msda-triton supports.
- gpu, verify, distributed: on a CUDA machine, offline, with that machine's torch and Triton (the full suite,
  the five-stage verification, DDP and FSDP2 on two GPUs with NCCL).
- report, bench: every backend on every case (errors and times), and the timing tables (msda-benchmarks).
- integrations: msda_core.patch, the extension shims and the kernels layer on real transformers, ultralytics,
  rfdetr and mmdet models (torch 2.14.1 and torchvision), then on older releases: ultralytics 8.3, mmcv 1.7,
  transformers 5.22 with kernels. Between the two, deploy's tests, in the same virtualenv.
- deploy: every runtime users ship on, on the CPU, against the patched model's eager output (deploy/): onnxruntime,
  OpenVINO, ExecuTorch, LiteRT, coremltools (conversion only off macOS), TensorRT's graphs checked statically.

MSDA_TORCH overrides the torch requirement (default torch==2.13.0, the CPU build on local disk here). The sessions
run on the Python that runs nox: CI's is 3.11, the one version the packages claim (requires-python >=3.11).

Disk: pip installs with no byte-compiling (Python compiles what is imported: most of torch never is) and no cache,
and a session that passes removes its virtualenv, which nox would create afresh on the next run anyway: a fresh
``nox`` leaves almost nothing under .nox/ (the integrations one alone holds 7 GB: torch 2.14.1 with its CUDA
libraries). MSDA_KEEP_VENVS=1 keeps them, for ``nox -r`` (reuse) afterwards.
"""

import glob
import os
import shutil
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "packages", "cpu", "compile_ptx", "integrations"]

TORCH = os.environ.get("MSDA_TORCH", "torch==2.13.0")
PACKAGES = ("msda-core", "msda-reference", "msda-triton", "msda-testkit", "msda-benchmarks")
TEST_DIRS = [f"packages/{p}/tests" for p in PACKAGES]
MYPY = "mypy==2.4.1"
LOWEST_TRITON = "3.6.0"  # msda-triton's triton>=3.6: what the GPU machine runs with torch 2.11


def install(session, *args, **kwargs):
    """session.install with no .pyc written (Python compiles what is imported) and no pip cache (see the top)."""
    session.install("--no-compile", "--no-cache-dir", *args, **kwargs)


def release(session):
    """The session passed: remove its virtualenv (nox makes a new one on its next run, unless reused; see the
    top), unless MSDA_KEEP_VENVS=1."""
    if os.environ.get("MSDA_KEEP_VENVS") != "1":
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def install_ours(session, *packages):
    """Our packages without their dependencies (installed explicitly), built with no network."""
    install(session, "--no-build-isolation", "--no-deps", *[f"packages/{p}" for p in packages])


def build_wheels(session) -> dict:
    """package name -> the path of its wheel, built from the tree with no network."""
    install(session, "setuptools>=77")
    folder = os.path.join(session.create_tmp(), "wheels")
    for path in glob.glob(os.path.join(folder, "*.whl")):
        os.remove(path)
    for p in PACKAGES:  # setuptools adds what a previous build left in build/lib, files since removed included
        shutil.rmtree(f"packages/{p}/build", ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", folder,
                *[f"packages/{p}" for p in PACKAGES])
    return {p: glob.glob(os.path.join(folder, p.replace("-", "_") + "-*.whl"))[0] for p in PACKAGES}


@nox.session
def lint(session):
    install(session, "ruff==0.17.6")
    session.run("ruff", "check", ".")
    names = [os.path.basename(p) for d in TEST_DIRS for p in glob.glob(f"{d}/*.py")]
    shared = sorted({n for n in names if names.count(n) > 1 and n != "conftest.py"})
    if shared:  # one pytest run over every package (gpu) imports test modules by file name
        session.error(f"test files share a name across packages, which nox -s gpu cannot collect: {shared}")
    release(session)


@nox.session
def packages(session):
    """Build every package's wheel and check the metadata the wheels carry: each range a package declares for a
    sibling (in its dependencies or extras) admits that sibling's version, and package data is inside."""
    install(session, "packaging")
    wheels = build_wheels(session)
    session.run("python", "ci/check_wheels.py", *wheels.values())
    release(session)


@nox.session
def cpu(session):
    wheels = build_wheels(session)
    pytest = ("pytest", "-q", "-n", "2", *session.posargs)
    # Inductor compiles in the calling process: on CI's 2 cores its pool of compile workers costs more than it
    # saves (msda-reference's tests with a cold cache: 111 against 94 s)
    session.env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    install(session, TORCH, "pytest-xdist")
    # 1. msda-core with what its tests declare (the testkit, and so msda-reference): no Triton.
    install(session, "--find-links", os.path.dirname(wheels["msda-core"]), f"{wheels['msda-core']}[test]")
    # mypy (mypy.ini: msda-core and msda-reference) here, against the torch just installed: in lint it would cost
    # a second install of torch, about a minute of CI
    install(session, MYPY)
    session.run("mypy")
    # torch warns on import that NumPy is absent: msda-core needs none, and installs none here, so that nothing of
    # it can import NumPy unnoticed
    session.run(*pytest, "-W", "ignore:Failed to initialize NumPy:UserWarning", "packages/msda-core/tests")
    # 2. The reference-only install (msda-core + msda-reference, no Triton) gives CPU inference; then the tests
    # of msda-reference, of the testkit and of the tools, with what they declare (onnxscript, onnxruntime).
    install(session, "--find-links", os.path.dirname(wheels["msda-core"]), f"{wheels['msda-reference']}[test]")
    session.run("python", "-c", "import importlib.util as u, sys; "
                "sys.exit('triton must be absent here' if u.find_spec('triton') else 0)")
    session.run("python", "examples/quickstart.py")
    install(session, "--find-links", os.path.dirname(wheels["msda-core"]), f"{wheels['msda-benchmarks']}[test]")
    session.run(*pytest, "packages/msda-reference/tests", "packages/msda-testkit/tests",
                "packages/msda-benchmarks/tests")
    # The Examples in the public API's docstrings, run on the installed packages as a user would (CPU, no Triton;
    # onnxscript is in for the export tables'). One process: two xdist workers cost more to start than they save.
    session.run("pytest", "-q", "--doctest-modules", "--pyargs", "msda_core", "msda_reference")
    # 3. msda-triton, its kernels in Triton's CPU interpreter, and the verification's CPU slice (stage 5 needs
    # a GPU; sequential replays: 3 suffice).
    install(session, "--find-links", os.path.dirname(wheels["msda-core"]), f"{wheels['msda-triton']}[test,interpreter]")
    session.run(*pytest, "packages/msda-triton/tests", env={"TRITON_INTERPRET": "1"})
    session.run("python", "-m", "msda_testkit.verify", "--device", "cpu", "--replays", "3",
                env={"TRITON_INTERPRET": "1"})
    # 4. Every kernel variant compiled for the GPUs on the newest Triton, the one installed here (compile_ptx: the
    # lowest), which spares a virtualenv of its own
    session.run("python", "-m", "msda_triton.compile_ptx")
    release(session)


@nox.session
def compile_ptx(session):
    """Every kernel variant compiled for sm_80 and sm_90 on the lowest Triton msda-triton supports (the cpu session
    compiles them on the newest)."""
    install(session, f"triton=={LOWEST_TRITON}", "setuptools>=77")
    install_ours(session, "msda-triton")
    session.run("python", "-m", "msda_triton.compile_ptx", *session.posargs)
    release(session)


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
    install(session, TORCH, "setuptools>=77", "tabulate", "triton")
    install_ours(session, *PACKAGES)
    session.run("python", "-m", "msda_benchmarks.report", *session.posargs)


@nox.session
def bench(session):
    install(session, TORCH, "setuptools>=77", "tabulate", "triton", "matplotlib")
    install_ours(session, *PACKAGES)
    session.run("python", "-m", "msda_benchmarks.bench", *session.posargs)
    session.run("python", "-m", "msda_benchmarks.overhead", "--calls", "500")  # the host floor, from the same run


# PyPI's torchvision, which ultralytics and mmcv.ops need, does not import beside torch 2.13.0: these two are a pair.
INTEGRATIONS_TORCH = ("torch==2.14.1", "torchvision==0.29.1")
INTEGRATIONS_LIBRARIES = ("transformers==5.24.0", "ultralytics==8.4.190",  # the versions integrations/ was read from
                          "rfdetr==1.11.2", "mmdet==3.3.0", "mmcv-lite==2.1.0",  # mmdet 3.3 refuses mmcv 2.2
                          "mmengine==0.10.7")
# The second pass: older releases over the first pass's. mmcv 1.7.2 (BEVFormer's lineage) is an sdist built with no
# ops (its setup.py needs pkg_resources); transformers 5.22.2 is the newest that accepts kernels 0.17.2, the newest
# kernels on PyPI (5.23 and later ask for kernels >= 0.18.2).
INTEGRATIONS_OLDER = ("ultralytics==8.3.253", "mmcv==1.7.2", "transformers==5.22.2", "kernels==0.17.2")
INTEGRATIONS_OLDER_TESTS = ("test_ultralytics.py", "test_extension_shims.py", "test_kernels.py")


# The runtimes of the README's Deploy table, each the release its row was tested with. numpy 2.4 breaks coremltools
# 9.0's conversion (coremltools#2633); ultralytics' CoreML export asks for numpy <= 2.3.5 too.
DEPLOY_RUNTIMES = ("onnxruntime==1.31.1", "onnx==1.23.2", "onnxscript==0.7.2", "openvino==2026.4.1",
                   "executorch==1.5.1", "coremltools==9.0", "litert-torch==0.10.0", "ai-edge-litert==2.3.0",
                   "onnxsim==0.8.1", "numpy==2.3.5")


def install_libraries(session):
    """torch 2.14.1, the libraries integrations/ and deploy/ run and the runtimes deploy/ exports to: one virtualenv
    for both, since torch 2.14.1 with its CUDA libraries alone is 5.5 GB to install."""
    install(session, *INTEGRATIONS_TORCH)
    install(session, *INTEGRATIONS_LIBRARIES, *DEPLOY_RUNTIMES, "pytest", "pytest-xdist", "tabulate",
            "setuptools>=77")
    install_ours(session, "msda-core", "msda-reference", "msda-testkit")
    # yapf (mmengine imports it) caches its grammar tables in the user's cache folder at its first import after an
    # install; two pytest workers importing it at once can read the other's half-written table (EOFError, seen
    # once in CI). One import first writes them.
    session.run("python", "-c", "import yapf")


def run_deploy(session, *args):
    env = {"YOLO_OFFLINE": "1", "MSDA_DEPLOY_CACHE": os.path.join(session.create_tmp(), "exports")}
    session.run("pytest", "-q", "-rs", "-n", "2", "-p", "no:cacheprovider", "deploy", *args, env=env)


@nox.session
def integrations(session):
    """msda on real transformers, ultralytics and mmdet models and on the extension shims, float64 on the CPU
    (integrations/); then every runtime of the Deploy table (deploy/, as the deploy session) in the same
    virtualenv; then integrations/ again on the older releases its tests also cover. Its GPU test skips without
    CUDA."""
    pytest = ("pytest", "-q", "-rs", "-n", "2")
    install_libraries(session)
    session.run(*pytest, "integrations", *session.posargs)
    run_deploy(session, *session.posargs)
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "mmcv-lite")
    install(session, "setuptools<80")
    install(session, "--no-build-isolation", *INTEGRATIONS_OLDER, env={"MMCV_WITH_OPS": "0"})
    session.run(*pytest, *[f"integrations/{t}" for t in INTEGRATIONS_OLDER_TESTS], *session.posargs)
    release(session)


@nox.session
def deploy(session):
    """Each runtime of the README's Deploy table on the CPU (deploy/) alone: the op and tiny patched transformers
    and ultralytics models, exported as users export them, each run against the patched model's eager output. CI
    runs these inside the integrations session."""
    install_libraries(session)
    run_deploy(session, *session.posargs)
    release(session)
