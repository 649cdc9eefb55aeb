"""scripts/accelerator_tables.sh: its phases are checked before anything runs, and the
device phase records where the tables were made. (Its experiment phases are the commands
the experiments tests run; on CPU they run with SPECJAX_ACCEL_ARGS sizing them down.)"""

import os
import re
import subprocess

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "accelerator_tables.sh")


def test_unknown_phases_are_refused_before_any_runs(tmp_path):
  out = subprocess.run([SCRIPT, str(tmp_path / "out"), "device", "tables"],
                       capture_output=True, text=True)
  assert out.returncode == 2
  assert "unknown phase 'tables'" in out.stderr
  assert not (tmp_path / "out").exists()


def test_the_device_phase_records_the_commit_and_devices(tmp_path):
  out = subprocess.run([SCRIPT, str(tmp_path), "device"], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  text = (tmp_path / "device.txt").read_text()
  assert re.search(r"^[0-9a-f]{40}$", text, re.M), text  # the commit
  assert re.search(r"^jax \S+ cpu \[", text, re.M), text  # version, backend, devices
  assert "phase device" in (tmp_path / "phases.log").read_text()


def test_a_phase_out_of_time_is_logged_and_the_next_one_runs(tmp_path):
  env = dict(os.environ, SPECJAX_PHASE_SECONDS="1",
             SPECJAX_ACCEL_ARGS="--target=tiny --draft=tiny --experiment=gamma_sweep")
  out = subprocess.run([SCRIPT, str(tmp_path), "default", "device"], capture_output=True,
                       text=True, env=env)
  assert out.returncode == 0, out.stderr
  log = (tmp_path / "phases.log").read_text().splitlines()
  assert re.fullmatch(r"phase default: \d+ s, exit 124", log[0]), log  # timeout's status
  assert re.fullmatch(r"phase device: \d+ s, exit 0", log[1]), log
  assert (tmp_path / "device.txt").exists()


def _phase(out_dir, phase: str, **env) -> None:
  """Runs one phase with extra environment; it must succeed and be logged as such."""
  out = subprocess.run([SCRIPT, str(out_dir), phase], capture_output=True, text=True,
                       env=dict(os.environ, **env))
  assert out.returncode == 0, out.stderr
  log = (out_dir / "phases.log").read_text().strip()
  assert re.fullmatch(rf"phase {phase}: \d+ s, exit 0", log), log


def test_the_dispatch_phase_writes_one_table_per_shape(tmp_path):
  _phase(tmp_path, "dispatch", SPECJAX_DISPATCH_ARGS="--shape=tiny --dtype=float32 "
         "--impls=cpu,reference --batch_sizes=1 --tokens=1,4 --contexts=16 --repeats=1")
  for shape in ("smollm2_135m", "llama3_8b"):  # the tiny flag sizes both runs down on CPU
    rows = [l for l in (tmp_path / f"attention_dispatch_{shape}.md").read_text().splitlines()
            if l.startswith("| 16 |")]
    assert [l.split("|")[2:4] for l in rows] == [[" 1 ", " 1 "], [" 1 ", " 4 "]], rows


def test_the_verify_phase_writes_the_curve_and_a_labelled_prediction(tmp_path):
  _phase(tmp_path, "verify", SPECJAX_VERIFY_ARGS="--shape=tiny --dtype=float32 "
         "--batch_sizes=1,2 --tokens=1,2,4 --repeats=1")
  text = (tmp_path / "verify_curve.md").read_text()
  assert "a prediction, not a measurement" in text
  rows = [l for l in text.splitlines() if re.match(r"\| [12] \| ", l)]
  assert len(rows) == 4, text  # B = 1 and 2 in the curve, then in the prediction
