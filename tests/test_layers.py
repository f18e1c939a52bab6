"""The package's structure (scripts/check_layers.py): modules import only downward through the
layers, no import circles, no function-level imports of the project's own modules and no public
function wider than 10 parameters, each exception named with its reason in the script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_rules_hold():
    r = _checker().report()
    assert r["modules"] > 80
    assert r["circles"] == []
    assert r["upward_imports"] == []
    assert r["inner_imports"] == []
    assert r["wide_functions"] == []


def test_the_checker_sees_what_it_forbids(tmp_path):
    """On a small package written for the purpose, each rule finds its violation."""
    chk = _checker()
    pkg = tmp_path / "graft_spec"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "op.py").write_text("from ..calibration import x\n")                 # upward
    (pkg / "calibration.py").write_text(
        "from .kernels import op\n"                                                         # circle
        "def f(a, b, c, d, e, f, g, h, i, j, k):\n    from . import step\n")               # wide, inner
    (pkg / "step.py").write_text("")
    for name in ("sglang_patch", "vllm_worker"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    r = chk.report(tmp_path)
    assert r["circles"] == [["graft_spec.calibration", "graft_spec.kernels.op"]]
    assert r["upward_imports"] == [["graft_spec.calibration", "graft_spec.step"],         # state -> round
                                   ["graft_spec.kernels.op", "graft_spec.calibration"]]   # ops -> state
    assert r["inner_imports"] == [["graft_spec.calibration", 3, "graft_spec.step"]]
    assert r["wide_functions"] == [["graft_spec.calibration", 2, "f", 11]]
