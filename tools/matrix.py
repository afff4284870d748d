"""Finding the interpreters the version matrix and the GPU check run on.

The version matrix itself is noxfile.py (`make test-matrix`, docs/install.md). This module
keeps the interpreter lookup it shares with tools/gpu_check.py and
tools/check_gpu_requirements.py, none of which may need nox to import it: an interpreter of
a given major.minor that runs and can make venvs, named by TORCHJAX_PYTHON3_12 (likewise
3_11, 3_13), else python3.12 on PATH, else pyenv's newest 3.12.x. nox's own lookup is not
used because it does not look in pyenv's versions/ (only at PATH, where pyenv's shims stand
for every version but run only the selected ones).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys


def _patch_number(path: str) -> int:
    m = re.search(r"/versions/\d+\.\d+\.(\d+)", path)
    return int(m.group(1)) if m else -1


def find_python(version: str) -> str | None:
    """An interpreter of `version` (major.minor) that runs and can make venvs, or None.

    The interpreter itself, not the pyenv shim that found it: a shim runs whichever version
    pyenv selects at the time, so a venv's record of its base would not say which it was.
    """
    candidates = [os.environ.get("TORCHJAX_PYTHON" + version.replace(".", "_"))]
    candidates.append(shutil.which(f"python{version}"))
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30)
        found = glob.glob(f"{root.stdout.strip()}/versions/{version}.*/bin/python{version}")
        candidates += sorted(found, key=_patch_number, reverse=True)
    except (OSError, subprocess.SubprocessError):
        pass
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        candidates.append(sys.executable)
    for exe in filter(None, candidates):
        probe = "import sys, venv; print('%d.%d' % sys.version_info[:2], sys.executable)"
        try:  # a pyenv shim exists for every version but runs only the selected ones
            out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        found, _, real = out.stdout.strip().partition(" ")
        if out.returncode == 0 and found == version:
            return real or exe
    return None


if __name__ == "__main__":
    sys.exit("the version matrix is noxfile.py now: `make test-matrix`, or .venv/bin/nox -l")
