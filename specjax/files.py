"""Files written whole or not at all: caches, checkpoints' shards and results that several
processes (pytest workers, resumed runs) may write or read at once."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
  """A temporary path beside ``path`` to write to, renamed over ``path`` when the block ends
  without error and removed when it raises.

  A reader never sees a partial file, a run cut off mid-write leaves the old file (or
  none), and concurrent writers each rename a whole one (the last wins). ``suffix``: the
  ending a writer appends when it is missing (``".npz"`` for ``np.savez``, ``".npy"`` for
  ``np.save``). The parent directory is created.

  Example::

    with atomic_path("cache/table.npz", ".npz") as tmp:
      np.savez(tmp, table=table)
  """
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp{suffix}"
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_text(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` atomically (``atomic_path``)."""
  with atomic_path(path) as tmp:
    with open(tmp, "w") as f:
      f.write(text)
