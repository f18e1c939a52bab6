"""Run many invalid graft launches' start-up in one process: SGLang's own argument parsing and
resolution (``sglang/launch_server.py``: `load_plugins`, ``prepare_server_args``,
``ServerArgs.resolve_once``, where graft's ``handle_server_args`` validates), which is where
``python -m sglang.launch_server`` refuses them before it starts any process or loads a model.

    python tests/serving/refusals.py CASES.json     # {name: {"argv": [...], "env": {...}}}

Prints one JSON object ``{name: {"rc": int, "out": str}}`` (rc 0: the arguments were accepted).
One import of SGLang instead of one per case (each launch spends most of its time importing).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def main(path: str) -> int:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    cases = json.loads(open(path).read())
    results = {}
    for name, case in cases.items():
        buf, saved = io.StringIO(), dict(os.environ)
        os.environ.update(case.get("env", {}))
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                prepare_server_args(case["argv"]).resolve_once()
                rc = 0
            except SystemExit as exc:          # argparse: an unknown flag
                rc = exc.code if isinstance(exc.code, int) else 1
            except Exception:                  # noqa: BLE001 - the refusal, printed as the launcher would
                traceback.print_exc(file=buf)
                rc = 1
            finally:
                os.environ.clear()
                os.environ.update(saved)
        results[name] = {"rc": rc, "out": buf.getvalue()}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
