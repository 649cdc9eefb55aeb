"""Runs a flag-driven module's ``main`` once per argument list, in one process.

Usage: python tests/flag_refusals.py MODULE 'JSON list of argument lists'

Prints a JSON list with, for each argument list, {"code": exit status, "stderr": what it
wrote}: what ``python -m MODULE ARGS`` would give, for the refusals the tests check (a flag
its parser or a validator refuses, a ``UsageError``, an exception from ``main``), without
paying a new interpreter and its imports per case. Between cases every flag is reset to its
default (``FLAGS.unparse_flags``).
"""

import contextlib
import importlib
import io
import json
import os
import sys
import traceback

from absl import app, flags


def run(module, args: list[str]) -> dict:
  flags.FLAGS.unparse_flags()
  err, code = io.StringIO(), 0
  with contextlib.redirect_stderr(err):
    try:
      argv = flags.FLAGS([module.__name__] + args)
      module.main(argv)
    except flags.Error as e:  # as app.run reports a flag it cannot parse
      print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
      code = 1
    except app.UsageError as e:
      print(str(e), file=sys.stderr)
      code = e.exitcode
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      if not isinstance(e.code, (int, type(None))):
        print(e.code, file=sys.stderr)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 1
  return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
  # The repository, as ``python -m`` from its root has it (a script's path is its folder's).
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  target = importlib.import_module(sys.argv[1])
  print(json.dumps([run(target, args) for args in json.loads(sys.argv[2])]))
