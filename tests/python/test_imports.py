"""The import graph: mhc.tpu (pure Python and Pallas) imports without the compiled C++ extension,
and never imports mhc.jax (mhc.jax imports mhc.tpu, not the reverse)."""

import os
import subprocess
import sys

# A fresh interpreter in which importing the C++ extensions fails as where they were never built;
# it imports mhc.tpu and its test switch, names the mhc modules loaded, then tries mhc.jax.
PROBE = """
import importlib.abc
import sys

class NoExtension(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("mhc._mhc_cpu", "mhc._mhc_cuda"):
            raise ImportError(f"{name} blocked by the test")
        return None

sys.meta_path.insert(0, NoExtension())
import mhc.tpu
import mhc.tpu.testing

print(sorted(name for name in sys.modules if name.startswith("mhc")))
try:
    import mhc.jax
except ImportError as error:
    print("mhc.jax:", error)
"""


def test_mhc_tpu_imports_without_the_cpu_extension():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=dict(os.environ), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    # The finder is live: mhc.jax, which needs the extension, fails to import under it.
    assert "mhc.jax: mhc._mhc_cpu blocked by the test" in result.stdout, result.stdout
    loaded = eval(result.stdout.splitlines()[0])  # the list the probe printed
    assert "mhc.tpu" in loaded and "mhc.tpu.testing" in loaded, loaded
    assert not [name for name in loaded if name.startswith(("mhc.jax", "mhc._mhc"))], loaded
