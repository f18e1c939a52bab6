"""Shared pytest fixtures.

``quick_models``: the small real target + EAGLE-3 head from ``scripts/make_models.py --quick``,
built into ``models/quick`` (about a minute on 2 CPU cores) and reused while the preset is unchanged.

The build runs at session start, before collection, because some server-test modules read the
models' tokenizer at import time (prompt ids) and skip when the models are absent: built at
session start they never skip on a fresh clone (CI). ``GRAFT_NO_MODEL_BUILD=1`` opts out for
quick core-only runs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: The kernel-against-reference files need Triton's interpreter switched on before Triton is
#: imported: tests/test_kernels.py runs them in a subprocess with it; the main run leaves them out.
collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpret/*"]


@dataclass(frozen=True)
class ModelPaths:
    """Directories of a built model pair: ``root`` holds ``target/``, ``draft/``, ``metrics.json``."""

    root: Path
    target: Path
    draft: Path
    metrics: Path


@functools.cache
def ensure_models(root: Path, quick: bool = True) -> ModelPaths:
    """Build, finish or refresh the models in ``root`` (once per test session: cached).

    Always runs make_models.py, which skips every stage whose fingerprint (preset fields, seed,
    Python version, upstream stages) matches, in a few seconds; so models left by an older preset
    are rebuilt instead of silently reused (a stale local ``models/quick`` once hid a preset
    change that CI then built from scratch). Concurrent builders serialise on a lock file next to
    ``root`` (taken by make_models.py). Raises ``subprocess.CalledProcessError`` if the build fails.
    """
    cmd = [sys.executable, str(REPO / "scripts" / "make_models.py"), "--out", str(root)]
    subprocess.run(cmd + (["--quick"] if quick else []), check=True)
    return ModelPaths(root, root / "target", root / "draft", root / "metrics.json")


def _quick_root() -> Path:
    return Path(os.environ.get("GRAFT_QUICK_MODELS", REPO / "models" / "quick"))


def pytest_sessionstart(session) -> None:
    """Build the quick models before collection (see the module docstring)."""
    if os.environ.get("GRAFT_NO_MODEL_BUILD") != "1":
        ensure_models(_quick_root())


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run tests/test_kernels.py last: its fixtures wait for the background kernel checks
    (tests/kernel_checks.py, started at collection), which then overlap the whole suite instead of
    holding it up where the file falls in alphabetical order."""
    last = [item for item in items if Path(str(item.fspath)).name == "test_kernels.py"]
    if last:
        items[:] = [item for item in items if Path(str(item.fspath)).name != "test_kernels.py"] + last


def pytest_collection_finish(session) -> None:
    """Start the kernel checks in the background when tests/test_kernels.py is selected
    (tests/kernel_checks.py): their single-core interpreter run overlaps the other tests."""
    if os.environ.get("TRITON_INTERPRET") != "1" and any(Path(str(item.fspath)).name == "test_kernels.py"
                                                         for item in session.items):
        import kernel_checks

        kernel_checks.start()


@pytest.fixture(scope="session")
def quick_models() -> ModelPaths:
    """Paths of the quick models (``GRAFT_QUICK_MODELS`` overrides the default ``models/quick``)."""
    return ensure_models(_quick_root())


@pytest.fixture(scope="session")
def code_reference(quick_models) -> list[list[int]]:
    """Greedy output ids of the quick target without speculation (concurrency 1) for the code prompts
    of tests/test_sglang_graft_server.py (``CODE``, ``MAX_NEW`` tokens, its ``COMMON`` server
    arguments): one server start for every module that compares against them (that module and
    tests/test_sglang_tp.py)."""
    from sglang_server import generate_many, serve
    from test_sglang_graft_server import CODE, COMMON, MAX_NEW, N_PROMPTS

    assert len(CODE) == N_PROMPTS, "prompt ids are read at import time: models must exist (conftest builds them)"
    with serve(quick_models.target, COMMON, name="code_ref") as srv:
        outs = generate_many(srv.url, CODE, concurrency=1, max_new_tokens=MAX_NEW)
    assert all(not o["meta_info"].get("spec_verify_ct") for o in outs)
    return [o["output_ids"] for o in outs]


@pytest.fixture
def check_hook_registration(monkeypatch):
    """A check for a plugin hook registered through ``sglang_patch.hooks.register_hook`` with
    ``only_if_imported``: ``check(register, module, target, hook, kind)`` asserts that ``register()``
    registers nothing while ``module`` is not imported, then ``hook`` on ``target`` exactly once
    (``HookRegistry.register`` recorded, not applied)."""
    import types

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_patch import hooks

    def check(register, module: str, target: str, hook, kind) -> None:
        calls = []
        monkeypatch.setattr(HookRegistry, "register",
                            classmethod(lambda cls, t, h, k=kind: calls.append((t, h, k))))
        monkeypatch.setattr(hooks, "_HOOKED", set())
        monkeypatch.delitem(sys.modules, module, raising=False)
        assert register() is False and calls == []            # e.g. the HTTP process
        monkeypatch.setitem(sys.modules, module, types.ModuleType("fake"))
        assert register() is True
        assert register() is False                            # idempotent
        assert calls == [(target, hook, kind)]

    return check
