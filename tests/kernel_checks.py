"""The kernel checks of tests/test_kernels.py, run in the background while the rest of the suite runs.

Two single-core jobs, chained in one subprocess (``python tests/kernel_checks.py OUT``): every
tests/interpret file under ``TRITON_INTERPRET=1`` (Triton must see the switch before it is imported;
this session's Triton was imported by SGLang already) with the launch and launcher-op recorders on,
then the ``sm_90`` compile of every recorded launch (tests/kernel_launches.py; skipped without
Triton's NVIDIA backend). tests/conftest.py starts it as soon as collection selects
tests/test_kernels.py, so its minutes overlap the other tests; the fixtures there wait for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
#: every kernel-against-reference file, run in one interpreter subprocess
INTERPRETED = sorted(p.name for p in (ROOT / "tests" / "interpret").glob("test_*_interpreted.py"))
#: seconds each of the two jobs may take (the suite runs beside them)
JOB_TIMEOUT_S = 2400

_started: Optional[tuple[subprocess.Popen, Path]] = None


def start() -> Path:
    """Start the checks once per session; returns their output folder."""
    global _started
    if _started is None:
        out = Path(tempfile.mkdtemp(prefix="graft-kernel-checks-"))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(out)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _started = (proc, out)
    return _started[1]


def results() -> tuple[dict, Path]:
    """Wait for the checks (starting them if collection did not) and return ``(results, folder)``:
    ``results["interpreter"]`` / ``results["compile"]`` each ``{"returncode", "stdout", "stderr"}``
    (``compile`` None without Triton's NVIDIA backend); the folder holds ``launches.json`` and
    ``ops.json`` (tests/kernel_launches.py, tests/launcher_ops.py)."""
    out = start()
    proc = _started[0]
    proc.wait(timeout=2 * JOB_TIMEOUT_S + 60)
    path = out / "results.json"
    if not path.exists():
        raise RuntimeError(f"the kernel checks ended with {proc.returncode} and wrote no results ({out})")
    return json.loads(path.read_text()), out


def _job(cmd: list[str], env: dict) -> dict:
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}
    except subprocess.TimeoutExpired as exc:
        return {"returncode": -1, "stdout": str(exc.stdout or ""), "stderr": f"timed out after {JOB_TIMEOUT_S} s"}


def main(out: Path) -> None:
    path = f"{ROOT / 'tests'}{os.pathsep}{ROOT}"
    launches = out / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, GRAFT_RECORD_LAUNCHES=str(launches),
               GRAFT_RECORD_LAUNCHER_OPS=str(out / "ops.json"))
    interpreter = _job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *(str(ROOT / "tests" / "interpret" / f) for f in INTERPRETED)], env)
    compiled = None
    try:
        import triton.backends.nvidia  # noqa: F401
        has_nvidia = True
    except ImportError:
        has_nvidia = False
    if has_nvidia and launches.exists():
        env = dict(os.environ, PYTHONPATH=path, TRITON_CACHE_DIR=str(out / "triton_cache"))  # empty: ptxas runs
        env.pop("TRITON_INTERPRET", None)
        compiled = _job([sys.executable, str(ROOT / "tests" / "kernel_launches.py"), str(launches)], env)
    tmp = out / "results.json.part"
    tmp.write_text(json.dumps({"interpreter": interpreter, "compile": compiled}))
    tmp.rename(out / "results.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
