"""One version everywhere: include/mhc/version.h (where it is written), the Python package's
metadata (pyproject.toml reads the header) and ``mhc.__version__``."""

import re
from pathlib import Path

import pytest

import mhc

ROOT = Path(__file__).resolve().parents[2]


def header_version() -> str:
    text = (ROOT / "include" / "mhc" / "version.h").read_text()
    parts = [
        re.search(rf"^#define MHC_VERSION_{part} (\d+)$", text, re.MULTILINE) for part in ("MAJOR", "MINOR", "PATCH")
    ]
    assert all(parts), "version.h: a MHC_VERSION_MAJOR/MINOR/PATCH line is missing"
    return ".".join(match.group(1) for match in parts)


def test_pyproject_reads_the_header():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "pyproject.toml writes a version of its own"
    assert "version" in pyproject["project"]["dynamic"]
    provider = pyproject["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["input"] == "include/mhc/version.h"
    # What the build backend computes from the header (scikit_build_core.metadata.regex).
    match = re.search(provider["regex"], (ROOT / provider["input"]).read_text(), re.MULTILINE)
    assert match, "pyproject.toml's version regex does not match include/mhc/version.h"
    assert provider["result"].format(*match.groups(), **match.groupdict()) == header_version()


def test_package_version_is_the_header_version():
    # A mismatch here means the installed package was built from another version of the source.
    assert mhc.__version__ == header_version()
