"""The run's log of finished measurements: written as it goes, reread to resume.

``--out/progress.jsonl`` holds one JSON object per line: first a header (the
config, every field but ``out``, ``fresh`` and ``workers``, and the git commit), then one
record per finished measurement, appended and flushed the moment it ends. A
run that is interrupted keeps every setting it finished.

Resume rule: when ``progress.jsonl`` exists and its header equals this run's,
its records are reused and only the missing settings are measured (a complete
log re-renders the tables without measuring anything). Otherwise, or with
``--fresh``, the old log is kept as ``progress.<n>.jsonl`` and the run starts
over. A last line cut off mid-write is ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from absl import logging

from experiments.config import ExperimentConfig

LOG_NAME = "progress.jsonl"
NOT_COMPARED = ("out", "fresh", "workers")  # fields that do not change what is measured


def header(config: ExperimentConfig, commit: Optional[str]) -> dict[str, Any]:
  """What a log must match to be resumed (JSON-normalised: tuples become lists)."""
  cfg = {k: v for k, v in config.to_dict().items() if k not in NOT_COMPARED}
  return json.loads(json.dumps({"config": cfg, "git": commit}))


def _read(path: str) -> list[dict]:
  lines = []
  with open(path) as f:
    for line in f:
      try:
        lines.append(json.loads(line))
      except json.JSONDecodeError:
        break  # a line cut off by an interrupted write: everything before it is whole
  return lines


class ProgressLog:
  """Appends finished measurements to ``out_dir/progress.jsonl``.

  Attributes:
    path: the log file.
    records: the measurements reused from an earlier run of the same header.
  """

  def __init__(self, out_dir: str, head: dict[str, Any], fresh: bool = False):
    self.path = os.path.join(out_dir, LOG_NAME)
    self.records: list[dict] = []
    if os.path.exists(self.path):
      lines = _read(self.path)
      if not fresh and lines and lines[0] == {"header": head}:
        self.records = lines[1:]
        logging.info("resuming %s: %d measurements reused", self.path, len(self.records))
      else:
        kept = self._set_aside()
        logging.warning("%s is from a different config or commit%s; kept as %s, starting over",
                        self.path, " (--fresh)" if fresh else "", kept)
    if not self.records:
      with open(self.path, "w") as f:
        f.write(json.dumps({"header": head}) + "\n")

  def _set_aside(self) -> str:
    stem = self.path[:-len(".jsonl")]
    n = 1
    while os.path.exists(f"{stem}.{n}.jsonl"):
      n += 1
    os.replace(self.path, f"{stem}.{n}.jsonl")
    return f"{stem}.{n}.jsonl"

  def append(self, record: dict[str, Any]) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(record, default=float) + "\n")
      f.flush()
      os.fsync(f.fileno())
