"""SGLang 0.5.23's own JSON contract (`sglang/api/v1/api_types.py`), loaded at test time by file
path from the `sglang==0.5.23` wheel (`pip download --no-deps`, cached in `.whl/`). The `sglang`
package is never imported and none of its code is copied into the repository."""

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

SGLANG_VERSION = "0.5.23"
CACHE = pathlib.Path(__file__).resolve().parents[2] / ".whl"
MEMBER = "sglang/api/v1/api_types.py"


def _wheel() -> pathlib.Path:
  found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
  if not found:
    CACHE.mkdir(exist_ok=True)
    subprocess.run(
      [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "--quiet", "-d", str(CACHE)],
      check=True,
      timeout=600,
    )
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
  if not found:
    raise RuntimeError(f"pip download sglang=={SGLANG_VERSION} left no wheel in {CACHE}")
  return found[0]


def load_api_types():
  """The contract module (msgspec Structs with `from_json_value` / `to_json_value`)."""
  target = CACHE / f"sglang-{SGLANG_VERSION}-api_types.py"
  if not target.exists():
    with zipfile.ZipFile(_wheel()) as whl:
      target.write_bytes(whl.read(MEMBER))
  spec = importlib.util.spec_from_file_location("sglang_0_5_23_api_types", target)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
