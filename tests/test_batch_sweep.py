"""benchmarks.batch_sweep on the tiny target: the adaptive policy takes the swept tree as
one of its choices, priced by an acceptance table measured once per temperature, and a
rerun resumes from the JSON beside the report. (Its flags share names with
experiments.run's, so it runs in a subprocess, as a user runs it.)"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

# The tiny target's first layer as the draft (early exit): at T = 1 its chains are accepted
# at a rate well inside (0, 1), and the calibration's full tree accepts its rank-0 drafts
# 5-7 times in 8 prompts (the independent random draft, whose rank-0 draft the target's law
# takes only ~2 times, took it 0 times on one host, leaving the trees unpriced).
ARGS = ["--target=tiny", "--draft=early_exit:1", "--batch_sizes=1,2", "--temperatures=1",
        "--gammas=1", "--trees=2:2:3", "--new_tokens=8", "--rounds=1", "--prompts=2"]


def _sweep(out, *extra) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "benchmarks.batch_sweep", *ARGS, *extra,
                         f"--out={out}"], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_the_policy_chooses_among_chains_and_the_tree_and_a_rerun_resumes(tmp_path):
  out = tmp_path / "sweep.md"
  first = _sweep(out, "--rounds=2")  # an even round and an odd one
  assert first.returncode == 0, first.stderr[-3000:]
  assert "trees priced by a 2-deep acceptance table" in first.stderr
  assert "8 held-out prompts never timed" in first.stderr  # never training-side ones
  cells = json.loads((tmp_path / "sweep.json").read_text())
  assert sorted(c["batch"] for c in cells) == [1, 2]
  for c in cells:
    assert c["policy_trees"] and c["trees"] == ["tree k=2 D=2 N=3"]
    assert len(c["rank_accept"]) == 2 and 0.0 < c["chain_alpha"] < 1.0
    assert len(c["step_costs"]) == 2 and len(c["tree_costs"]) == 1
    assert min(c["step_costs"] + c["tree_costs"]) >= 1.0
    assert c["min_gain"] == 0.05  # the policy's default margin, recorded
    assert c["evidence"] == "expected"  # and what it counts of a sampled chain step
    assert c["matmul"]  # the matmul path the cell ran, recorded (experiments.machine)
    mix = c["methods"]["adaptive"]["choice_steps"]
    assert len(mix) == 3 and sum(mix) > 0  # plain, γ = 1, the tree
    # against the second plain call beside it, one ratio a round (before it, then after it)
    adaptive = c["methods"]["adaptive"]
    assert len(adaptive["paired_plain_rounds"]) == 2 and min(adaptive["paired_plain_rounds"]) > 0
    assert adaptive["paired_plain_speedup"] == pytest.approx(
        np.median(adaptive["paired_plain_rounds"]))
    assert isinstance(c["plain_only"], bool)
    if c["plain_only"]:  # plain decoding's own loop: plain steps only
      assert mix[1:] == [0, 0]
    assert all("paired_plain_speedup" not in v for n, v in c["methods"].items()
               if n != "adaptive")
  text = out.read_text()
  assert "| α_c | adaptive mix (0…1, tree) |" in text
  assert "promises more than 5% over plain decoding (`min_gain`)" in text
  assert "each draft's β weighted by its chance of being scored" in text
  assert f"Matmul path: {cells[0]['matmul']}." in text  # one path: said once
  assert "rows stopping at EOS" in text
  for c in cells:
    # (the tiny target has no EOS id: its rows run to the budget, so the loop scaling is
    # pinned by the unit test below, not here)
    assert c["stop_at_eos"] and c["plain_tokens"] == c["batch"] * c["batches"] * 8
    assert c["calibration"] == "held-out"
  assert [l.split("|")[1].strip() for l in text.splitlines() if l.startswith("| 1 |")
          or l.startswith("| 2 |")] == ["1", "2"]
  header = next(l for l in text.splitlines() if "adaptive, paired" in l).split("|")
  paired_col = header.index(" adaptive, paired ")
  mix_col = next(i for i, h in enumerate(header) if h.startswith(" adaptive mix"))
  row = next(l for l in text.splitlines() if l.startswith("| 1 |")).split("|")
  one, two = (next(c for c in cells if c["batch"] == b) for b in (1, 2))
  paired = one["methods"]["adaptive"]["paired_plain_speedup"]
  assert row[paired_col].strip().startswith(f"{paired:.2f}× (")

  # A cell from before the paired call renders a dash there; a policy that never drafted
  # says its calls ran plain decoding's loop.
  one["methods"]["adaptive"] = {k: v for k, v in one["methods"]["adaptive"].items()
                                if not k.startswith("paired")}
  one["plain_only"], two["plain_only"] = True, False
  (tmp_path / "sweep.json").write_text(json.dumps(cells))
  again = _sweep(out)  # everything was done: nothing is measured again
  assert again.returncode == 0, again.stderr[-3000:]
  assert "done before, kept" in again.stderr
  assert "acceptance table" not in again.stderr and "step costs" not in again.stderr
  rows = {l.split("|")[1].strip(): l.split("|") for l in out.read_text().splitlines()
          if l.startswith("| 1 |") or l.startswith("| 2 |")}
  assert rows["1"][paired_col].strip() == "–"
  assert rows["1"][mix_col].strip().endswith("(plain decoding's loop)")
  assert "plain decoding's loop" not in rows["2"][mix_col]

  # Another margin is another sweep: measured again, and the first margin's cells stay in
  # the store without entering the report.
  argmax = _sweep(out, "--batch_sizes=1", "--min_gain=0")
  assert argmax.returncode == 0, argmax.stderr[-3000:]
  assert "done before, kept" not in argmax.stderr and "step costs" in argmax.stderr
  cells = json.loads((tmp_path / "sweep.json").read_text())
  assert sorted((c["min_gain"], c["batch"]) for c in cells) == [(0.0, 1), (0.05, 1), (0.05, 2)]
  text = out.read_text()
  assert "`min_gain`" not in text  # the argmax: no margin to state
  assert [l.split("|")[1].strip() for l in text.splitlines() if l.startswith("| 1 |")
          or l.startswith("| 2 |")] == ["1"]


def test_only_cells_measured_alike_are_resumed(benchmark_module):
  """A stored cell resumes only for the same devices, margin and evidence; a cell that does
  not record its evidence (before it was carried: outcomes before git 3d3668c) is measured
  again."""
  resumable = benchmark_module("batch_sweep").resumable
  cell = dict(devices=1, min_gain=0.05, evidence="expected", stop_at_eos=True,
              calibration="held-out")
  assert resumable(cell, 1, 0.05, "expected", True)
  assert not resumable(cell, 2, 0.05, "expected", True)
  assert not resumable(cell, 1, 0.0, "expected", True)
  assert not resumable(cell, 1, 0.05, "accepted", True)
  assert not resumable(cell, 1, 0.05, "expected", False)
  assert not resumable(dict(devices=1, min_gain=0.05, stop_at_eos=True, calibration="held-out"),
                       1, 0.05, "expected", True)
  # priced on training-side prompts (no calibration recorded: before 0fe06c6)
  trainside = {k: v for k, v in cell.items() if k != "calibration"}
  assert not resumable(trainside, 1, 0.05, "expected", True)
  # the oldest cells' defaults (one device, the argmax, EOS ignored) are all training-side
  assert resumable(dict(evidence="accepted", calibration="held-out"), 1, 0.0, "accepted", False)
  assert not resumable(dict(evidence="accepted"), 1, 0.0, "accepted", False)


def test_plain_decoding_runs_again_right_beside_the_policy(benchmark_module):
  """Each round times plain decoding a second time next to the policy: right before it in
  even rounds, right after it in odd ones (also when the policy's call comes last), the
  other calls in their rotated order."""
  sweep = benchmark_module("batch_sweep")
  beside = sweep.BESIDE
  rotated = ["γ=1", "adaptive", None, "tree"]
  assert sweep.round_order(rotated, 0) == ["γ=1", beside, "adaptive", None, "tree"]
  assert sweep.round_order(rotated, 1) == ["γ=1", "adaptive", beside, None, "tree"]
  assert sweep.round_order([None, "adaptive"], 3) == [None, "adaptive", beside]
  assert sweep.round_order([None, "adaptive"], 2) == [None, beside, "adaptive"]
  assert rotated == ["γ=1", "adaptive", None, "tree"]  # the rotation itself is left alone
  assert beside is not None and beside not in rotated


def test_a_methods_decode_loop_is_scaled_to_plain_decodings_length(benchmark_module):
  """With rows stopping at EOS at T > 0, a method's call is compared at the length plain
  decoding's call on the batch ran for (each call's longest row): its decode loop scaled,
  its prefill as measured; unchanged where the lengths agree."""
  import types
  same = benchmark_module("batch_sweep")._same_length_seconds
  call = lambda seconds, prefill, lengths: types.SimpleNamespace(
      seconds=seconds, prefill_seconds=prefill, num_generated=np.asarray(lengths))
  plain = call(3.0, 0.2, [40, 100])  # the batch's loop ran for 100 tokens
  assert same(call(2.0, 0.5, [100, 7]), plain) == pytest.approx(2.0)
  spec = call(2.0, 0.5, [10, 50])  # half plain's longest row: its loop counted twice
  assert same(spec, plain) == pytest.approx(0.5 + 1.5 * 2)
  assert same(spec, plain) != pytest.approx(2.0 * 2)  # not the whole call scaled
  assert same(spec, plain) != pytest.approx(0.5 + 1.5 * 140 / 60)  # nor by total tokens
  assert same(call(1.0, 0.5, [0, 0]), call(1.0, 0.5, [0, 0])) == pytest.approx(1.0)


def test_bad_trees_are_refused_before_anything_is_measured(tmp_path, refused):
  case = lambda extra, message: ([*ARGS, extra, f"--out={tmp_path / 'sweep.md'}"], message)
  margin = "min_gain must be a finite number >= 0"
  refused("benchmarks.batch_sweep",
          case("--trees=2:2", "bad flag value"),  # no node budget
          case("--draft=prompt_lookup", "cannot build the trees"),  # root branches only
          case("--min_gain=-0.1", margin), case("--min_gain=nan", margin),
          case("--min_gain=inf", margin),
          case("--prompts=100000", "calibration prompts after the 100000 timed"),  # none left
          case("--evidence=outcomes", "--evidence"),
          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert not (tmp_path / "sweep.json").exists()


def _simulated(devices: int) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


@pytest.mark.heavy  # 135 s of the default run's four workers; the tiny model's mesh test stays
def test_data_parallel_rows_on_two_simulated_devices(tmp_path):
  """--data_parallel=2 shards every batch's rows over a 2 x 1 mesh and reports tokens/s per
  device; a store's cell of one device is neither resumed nor reported for it (it stays in
  the store); a batch the data axis does not
  divide and a mesh larger than the devices are refused before any model loads."""
  out = tmp_path / "sweep.md"
  one = _sweep(out, "--batch_sizes=2", "--trees=")  # one device first: kept beside
  assert one.returncode == 0, one.stderr[-3000:]
  run = subprocess.run([sys.executable, "-m", "benchmarks.batch_sweep", *ARGS,
                        "--batch_sizes=2", "--trees=", "--data_parallel=2", f"--out={out}"],
                       cwd=ROOT, capture_output=True, text=True, env=_simulated(2))
  assert run.returncode == 0, run.stderr[-3000:]
  assert "done before, kept" not in run.stderr
  cells = json.loads((tmp_path / "sweep.json").read_text())
  assert [c["devices"] for c in cells] == [1, 2]  # the one-device cell kept, not reported
  text = out.read_text()
  assert "rows sharded over 2 devices" in text and "adaptive tok/s per device" in text
  row = next(l for l in text.splitlines() if l.startswith("| 2 |")).split("|")
  header = next(l for l in text.splitlines() if "adaptive tok/s per device" in l).split("|")
  cols = dict(zip((h.strip() for h in header), (v.strip() for v in row)))
  assert float(cols["adaptive tok/s per device"]) == pytest.approx(
      float(cols["adaptive tok/s"]) / 2, abs=1)
  for extra, message in ((["--batch_sizes=3"], "does not divide its 3 rows"),
                         (["--data_parallel=4"], "needs 4 devices, but only 2 are present")):
    bad = subprocess.run([sys.executable, "-m", "benchmarks.batch_sweep", *ARGS,
                          "--data_parallel=2", *extra, f"--out={tmp_path / 'bad.md'}"],
                         cwd=ROOT, capture_output=True, text=True, env=_simulated(2))
    assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]
  assert not (tmp_path / "bad.json").exists()


def test_the_report_names_the_matmul_path_of_each_cell():
  from experiments.report import matmul_words
  cells = [dict(batch=1, temperature=0.0, matmul="kernel"),
           dict(batch=2, temperature=0.0, matmul="kernel")]
  assert matmul_words(cells) == "Matmul path: kernel."
  cells.append(dict(batch=4, temperature=1.0))  # measured before the path was recorded
  assert matmul_words(cells) == ("Matmul paths (the cells differ): T = 0 B = 1, T = 0 B = 2: "
                                  "kernel | T = 1 B = 4: not recorded.")
