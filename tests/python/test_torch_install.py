"""mhc[torch] without jax, in a real virtual environment: the install that `pip install mhc[torch]`
makes, built from this machine's files with no network, where jax is not installed at all.

The environment: ``venv`` (no pip, no system site-packages), into whose site-packages go links to
the mhc package under test (with the metadata pip would write) and to every installed distribution
that mhc's core dependencies, its ``torch`` extra (read from pyproject.toml) and, recursively,
their requirements name, plus the libraries of requirements-torch.txt (the project's CPU install of
torch: the CUDA wheel with ``--no-deps`` and the four NVIDIA libraries its shared objects load).
Requirements that are not installed here (torch's CUDA toolkit, cuDNN, triton: not needed on a CPU)
are left out, as the CPU install leaves them out. jax must not be among them, ``import jax`` must
fail there, and mhc.torch must import and run a sublayer forward and backward on the kernels."""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import venv

import pytest
import tomllib

pytest.importorskip("torch", reason="mhc.torch needs torch (pip install mhc[torch])")
from packaging.requirements import Requirement  # noqa: E402

import mhc  # noqa: E402

pytestmark = pytest.mark.slow  # a fresh interpreter importing torch: over 10 s of CPU on this machine

ROOT = pathlib.Path(__file__).resolve().parents[2]
JAX_DISTRIBUTIONS = {"jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_extra_requirements() -> list[Requirement]:
    """mhc's core dependencies and its torch extra, from the source tree's pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["torch"]]


def cpu_torch_requirements() -> list[Requirement]:
    """requirements-torch.txt: what make installs with --no-deps for torch on a CPU."""
    lines = (ROOT / "requirements-torch.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def closure(requirements: list[Requirement]) -> tuple[dict, set]:
    """Installed distributions (canonical name -> Distribution) that the requirements name,
    recursively (markers evaluated, extras followed), and the names required but not installed."""
    found, missing, seen, todo = {}, set(), set(), [(r, "") for r in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _canonical(requirement.name)
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for chosen in ("", *requirement.extras):  # a distribution's plain requirements and each extra's
            if (name, chosen) not in seen:
                seen.add((name, chosen))
                todo += [(Requirement(text), chosen) for text in found[name].requires or []]
    return found, missing


def link_distribution(distribution, site_packages: pathlib.Path) -> None:
    """Links a distribution's top-level files and packages (from its RECORD) into site_packages;
    a namespace directory (no __init__.py, shared by several distributions, like nvidia/) is made
    here and its sub-packages linked one by one."""
    source = pathlib.Path(distribution.locate_file(""))
    for file in distribution.files or []:
        parts = pathlib.PurePath(file).parts
        if parts[0] == ".." or "__pycache__" in parts:  # scripts in bin/, caches
            continue
        top = source / parts[0]
        if top.is_dir() and not (top / "__init__.py").exists() and not parts[0].endswith(".dist-info"):
            if len(parts) < 2:
                continue
            (site_packages / parts[0]).mkdir(exist_ok=True)
            target, link = top / parts[1], site_packages / parts[0] / parts[1]
        else:
            target, link = top, site_packages / parts[0]
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target)


WITHOUT_JAX = """
import sys

try:
    import jax
except ImportError as error:
    print("import jax:", type(error).__name__)
else:
    raise SystemExit(f"jax is importable in the venv: {jax.__file__}")
import torch
import mhc.torch as mt

assert "jax" not in sys.modules, "mhc.torch imported jax"
config = mt.Config(n=4)
x = torch.randn(3, 4, 8, requires_grad=True)
params = mt.init_params(config, 8)
layer_in, ctx = mt.pre(x, params, config)
out = mt.post(torch.tanh(layer_in), ctx)
out.sum().backward()
want_layer_in, want_ctx = mt.pre(x, params, config, use_kernel=False)
torch.testing.assert_close(layer_in, want_layer_in, rtol=1e-5, atol=1e-6)
assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
print("mhc.torch from", mt.__file__, "torch from", torch.__file__)
"""


def test_mhc_torch_installs_and_runs_in_a_venv_without_jax(tmp_path):
    found, missing = closure(torch_extra_requirements())
    assert not JAX_DISTRIBUTIONS & set(found), f"mhc[torch] pulls {sorted(JAX_DISTRIBUTIONS & set(found))}"
    assert "torch" in found and "numpy" in found, sorted(found)
    cpu_found, _ = closure(cpu_torch_requirements())
    found |= cpu_found
    assert not JAX_DISTRIBUTIONS & set(found), sorted(found)
    # What the CPU install leaves out: torch's CUDA requirements (the toolkit, cuDNN, triton), and
    # nothing else.
    assert all(name.startswith(("cuda-", "nvidia-")) or name == "triton" for name in missing), missing

    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True, system_site_packages=False).create(environment)
    python = environment / "bin" / "python"
    site_packages = pathlib.Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env={},
        ).stdout.strip()
    )
    assert site_packages.is_relative_to(environment), site_packages
    for distribution in found.values():
        if _canonical(distribution.metadata["Name"]) != "mhc":  # the mhc under test, linked below
            link_distribution(distribution, site_packages)
    (site_packages / "mhc").symlink_to(pathlib.Path(mhc.__file__).parent, target_is_directory=True)
    # mhc's metadata as pip writes it for mhc[torch] (mhc reads its version from it at import).
    metadata = site_packages / f"mhc-{mhc.__version__}.dist-info"
    metadata.mkdir()
    requires = [f"Requires-Dist: {r}" for r in torch_extra_requirements()]
    lines = ["Metadata-Version: 2.1", "Name: mhc", f"Version: {mhc.__version__}", *requires]
    (metadata / "METADATA").write_text("\n".join(lines) + "\n")

    # No PYTHONPATH or venv of the caller: the new environment's site-packages and nothing else.
    clean = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([python, "-c", WITHOUT_JAX], capture_output=True, text=True, timeout=600, env=clean)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "import jax: ModuleNotFoundError" in result.stdout, result.stdout
    assert f"mhc.torch from {site_packages}" in result.stdout, result.stdout
