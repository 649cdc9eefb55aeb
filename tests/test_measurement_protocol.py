"""The timing protocol of experiments.run: round spreads and flags, added rounds on the
unsteady settings and batches, one plain baseline per round, re-measurement, resuming."""

import dataclasses
import json
import os

import numpy as np
import pytest

from experiments.config import ExperimentConfig
from specjax.speculative import SpeculativeDecoder


def test_spreads():
  from experiments.checks import quartile_spread, spread
  assert spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
  assert spread([2.0]) is None
  # one outlier in eight moves the range, not the interquartile spread
  steps = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
  assert spread(steps) == pytest.approx(2.0) and quartile_spread(steps) == pytest.approx(0.0)
  assert quartile_spread([1.0, 2.0, 3.0]) is None


@pytest.mark.parametrize("gamma, verify, spread_, draft_spread, expected", [
    (4, 2.0, 0.05, 0.1, []),
    (4, 5.0, 0.0, None, []),                                 # γ+1 itself is possible
    (4, 5.01, 0.0, None, ["verify cost 5.01 outside (0, γ+1 = 5]"]),
    (2, 110.0, None, None, ["verify cost 110.00 outside (0, γ+1 = 3]"]),
    (2, -0.5, None, None, ["verify cost -0.50 outside (0, γ+1 = 3]"]),
    (3, None, 0.10, None, []),                               # the bound itself passes
    (3, None, 0.12, None, ["speedup spread 12% > 10%"]),
    (3, 1.5, 0.0, 0.3, ["draft-phase spread 30% > 25% (c)"]),
])
def test_setting_flags_rule(gamma, verify, spread_, draft_spread, expected):
  from experiments.checks import setting_flags
  assert setting_flags(gamma, verify, spread_, draft_spread) == expected


def test_unsteady_picks_the_settings_and_batches_whose_speedup_spreads_in_one_group():
  from experiments.checks import unsteady
  plain, spec = [[1.0, 1.0], [1.0, 1.2]], [[1.0, 1.0], [1.0, 1.0]]
  assert unsteady([(plain, spec)], [(0, 1)]) == {}  # pooled: 1.0 -> 1.1, a 9.5% spread
  # batch 1 alone: 1.0 -> 1.2, 18%: one more round of batch 1 only
  assert unsteady([(plain, spec)], [(0, 1), (0,), (1,)]) == {0: [1]}
  steady = [[1.0, 1.0], [1.0, 1.0]]
  # pooled over both batches 1.0 -> 1.25: every batch of the group gets the round
  assert unsteady([(steady, steady), (steady, [[1.0, 1.0], [0.8, 0.8]])],
                  [(0, 1), (0,), (1,)]) == {1: [0, 1]}
  assert unsteady([(plain[:1], spec[:1])], [(0, 1), (1,)]) == {}  # one round: no spread


def test_a_round_that_left_a_batch_out_counts_only_for_the_groups_it_timed():
  from experiments.checks import complete_rounds, round_ratios
  plain = [[1.0, 1.0], [1.0, 1.2], [None, 1.1]]
  spec = [[1.0, 1.0], [1.0, 1.0], [None, 1.0]]
  assert complete_rounds(spec, [0, 1]) == [0, 1] and complete_rounds(spec, [1]) == [0, 1, 2]
  assert round_ratios(plain, spec, [0, 1]) == pytest.approx([1.0, 1.1])
  assert round_ratios(plain, spec, [1]) == pytest.approx([1.0, 1.2, 1.1])


def test_speedups_compare_equal_lengths_the_prefill_as_measured():
  """Rows stopping at EOS at T > 0: on batch 0 the speculative sample runs 1.5× as long as
  plain decoding's, so its decode loop (1 s − 0.5 s prefill in round 0) counts at 2/3 of its
  time; batch 1's lengths agree and stay as timed. The known-wrong variants, the plain
  ratio of wall times and one that scales the prefill too (per generated token), differ."""
  from experiments.measure import (SpecRun, length_scales, round_decode_speedups,
                                   round_speedups, same_length_seconds)
  toks = lambda *lens: [[[7] * n] for n in lens]
  run = SpecRun("d", 2, 1.0, counters=[{}, {}], generated=toks(30, 20), steps=[1, 1],
                seconds=[[1.0, 1.0], [2.0, 1.0]], plain_seconds=[[2.0, 2.0], [2.0, 2.0]],
                plain_generated=toks(20, 20), prefill_seconds=[[0.5, 0.5], [0.5, 0.5]],
                plain_prefill_seconds=[[0.5, 0.5], [0.5, 0.5]])
  assert length_scales(run) == pytest.approx([2 / 3, 1.0])
  np.testing.assert_allclose(same_length_seconds(run), [[0.5 + 0.5 * 2 / 3, 1.0],
                                                        [0.5 + 1.5 * 2 / 3, 1.0]])
  assert round_speedups(run, [0]) == pytest.approx([2.0 / (5 / 6), 2.0 / 1.5])
  assert round_speedups(run, [1]) == pytest.approx([2.0, 2.0])
  assert round_speedups(run, [0, 1]) == pytest.approx([4.0 / (11 / 6), 4.0 / 2.5])
  assert round_decode_speedups(run, [0]) == pytest.approx([1.5 / (1 / 3), 1.5 / 1.0])
  wall = [4.0 / 2.0, 4.0 / 3.0]
  per_token = [w * 50 / 40 for w in wall]
  for wrong in (wall, per_token):
    assert round_speedups(run, [0, 1]) != pytest.approx(wrong)
  same = dataclasses.replace(run, generated=toks(20, 20))
  assert round_speedups(same, [0, 1]) == pytest.approx(wall)
  # a batch's loop runs for its longest row; recorded with its padded rows, that one counts
  rows = dataclasses.replace(run, generated=[[[7] * 30, [7] * 5], [[7] * 20]],
                             plain_generated=[[[7] * 20, [7] * 25], [[7] * 20]])
  assert length_scales(rows) == pytest.approx([25 / 30, 1.0])
  padded = dataclasses.replace(rows, loop_tokens=[30, 40], plain_loop_tokens=[25, 20])
  assert length_scales(padded) == pytest.approx([25 / 30, 0.5])


@pytest.mark.parametrize("unsteady, rounds", [({}, [1, 1]), ({1: [0, 1]}, [1, 3]),
                                              ({1: [1]}, [1, 3])])
def test_rounds_are_added_for_the_unsteady_settings_and_batches_only(tmp_path, monkeypatch,
                                                                     unsteady, rounds):
  from experiments import experiment
  from experiments.checks import complete_rounds
  seen = []

  def fake_unsteady(timings, groups):
    seen.append(([len(p) for p, _ in timings], [len(s) for _, s in timings],
                 [list(g) for g in groups]))
    return unsteady

  monkeypatch.setattr("experiments.checks.unsteady", fake_unsteady)
  monkeypatch.setattr("experiments.measure.run_flags", lambda run, **_: [])
  config = dataclasses.replace(_two_gamma_config(tmp_path), extra_rounds=2, num_prompts=2,
                               batch_size=1)
  results = experiment.run(config)
  for r in results["runs"]:  # T = 0 and T = 1 alike
    assert len(r["seconds"]) == len(r["plain_seconds"]) == len(r["step_seconds"])
  by_gamma = {r["gamma"]: r for r in results["runs"] if r["temperature"] == 0}
  assert [len(by_gamma[g]["seconds"]) for g in sorted(by_gamma)] == rounds
  # added rounds time the batches fake_unsteady named, and plain decoding beside them;
  # their pooled step times exist only where they covered every batch
  run, added = by_gamma[2], unsteady.get(1)
  for field in ("seconds", "plain_seconds", "prefill_seconds", "plain_prefill_seconds"):
    for row in run[field][1:]:
      assert [i for i, x in enumerate(row) if x is not None] == added
  for field in ("step_seconds", "plain_step_seconds"):
    assert all((x is None) == (added != [0, 1]) for x in run[field][1:])
  # asked after each round from the --repeats-th on, up to the last one allowed, with
  # each setting's own rounds so far, per temperature of the sweep; the groups are all
  # batches and each category's
  expected = [[1, 1], [1, 2]] if unsteady else [[1, 1]]
  assert [p for p, _, _ in seen] == expected * 2
  assert all(p == s and groups == [[0, 1], [0], [1]] for p, s, groups in seen)
  # a row's speedup is the median over the rounds that timed all its batches
  rows = {(r["gamma"], r["category"]): r for r in results["rows"]
          if r["experiment"] == "gamma_sweep" and r["temperature"] == 0}
  cats = {c for _, c in rows if c != "all"}
  assert len(cats) == 2 and all(rows[1, c]["rounds"] == 1 for c in cats)
  assert rows[2, "all"]["rounds"] == len(complete_rounds(run["seconds"], [0, 1]))
  assert (sorted(rows[2, c]["rounds"] for c in cats) ==
          sorted(len(complete_rounds(run["seconds"], [i])) for i in (0, 1)))


def test_a_group_shares_its_added_rounds_and_its_second_measurement(tmp_path, monkeypatch):
  """The adaptive policy and the sweep's best γ timed beside it (``SpecRun.group``) share
  every round: an added round the first of them needs, and a second measurement only the
  policy's flags ask for. Outside a group the unsteady setting alone gets the round."""
  from experiments import experiment
  monkeypatch.setattr("experiments.checks.unsteady", lambda timings, groups: {0: [0]})
  monkeypatch.setattr("experiments.measure.run_flags", lambda run, **_: (
      ["spread"] if run.tree and run.tree[0] == "adaptive" else []))
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=2, gammas=(1, 2),
                            temperatures=(0.0,), max_new_tokens=4, batch_size=1,
                            experiments=("adaptive",), sweep_trees=(), cost_steps=2,
                            phase_seconds=0.01, repeats=2, extra_rounds=1, out=str(tmp_path))
  results = experiment.run(config)
  for t in (0.0, 1.0):
    group = [r for r in results["runs"] if r["group"] == "adaptive" and r["temperature"] == t]
    sweep = [r for r in results["runs"] if not r["group"] and r["temperature"] == t]
    assert len(group) == 2 and len(sweep) == 2
    fixed, policy = sorted(group, key=lambda r: r["tree"] is not None)
    assert policy["plain_seconds"] == fixed["plain_seconds"] and len(fixed["seconds"]) == 3
    assert policy["first_flags"] == ["spread"]
    assert fixed["first_flags"] == ["measured again with its group"]
    assert sorted(len(r["seconds"]) for r in sweep) == [2, 3]


def test_flagged_setting_is_remeasured_once_and_the_second_kept(tmp_path, monkeypatch):
  from experiments import checks, experiment
  seen = []

  def fake_flags(run, draft_phase=True):  # T=0 stays flagged, T=1 never is
    seen.append(run.temperature)
    return [f"spread {len(seen)}"] if run.temperature == 0 else []

  monkeypatch.setattr("experiments.measure.run_flags", fake_flags)
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=1, gammas=(2,),
                            temperatures=(0.0,), max_new_tokens=4, experiments=("gamma_sweep",),
                            sweep_trees=(), cost_steps=2, phase_seconds=0.01, repeats=2,
                            extra_rounds=0, out=str(tmp_path))
  results = experiment.run(config)
  assert seen == [0.0, 1.0]  # flags are read once: a flagged setting is measured twice at most
  first = {r["temperature"]: r["first_flags"] for r in results["runs"]}
  assert first == {0.0: ["spread 1"], 1.0: []}
  assert all(len(r["seconds"]) == 2 for r in results["runs"])  # one set of rounds kept
  assert "(re-measured)" in open(tmp_path / "tables.md").read()
  assert checks.SPREAD_BOUND == 0.10  # the bound tables.md states


def _two_gamma_config(out):
  return ExperimentConfig(target="tiny", draft="tiny", num_prompts=1, gammas=(1, 2),
                          temperatures=(0.0,), max_new_tokens=4, experiments=("gamma_sweep",),
                          sweep_trees=(), cost_steps=2, phase_seconds=0.01, repeats=1,
                          extra_rounds=0, out=str(out))


def test_checks_count_the_category_figures_still_flagged_beside_the_settings():
  """A setting that passed can have categories whose own rounds spread (each rests on fewer
  calls); Checks says how many, once each, instead of only 'No setting is flagged'."""
  from experiments import report
  spread = ["speedup spread 12% > 10%"]

  def row(category, flags, gamma=2, experiment="gamma_sweep"):
    return dict(experiment=experiment, category=category, flags=flags, speedup=1.4,
                draft="eagle", gamma=gamma, temperature=0.0, tree=None, remeasured=False)

  rows = [row("all", []), row("qa", spread), row("chat", spread), row("code", []),
          row("qa", spread, experiment="temperature_sweep")]  # the same figure, reused
  text = "\n".join(report._flag_section(rows))
  assert "No setting is flagged" in text
  assert "2 per-category figure(s) of the measured settings still flagged" in text
  assert "per-category" not in "\n".join(report._flag_section(rows[:1] + rows[3:4]))
  rows[0]["flags"] = spread
  text = "\n".join(report._flag_section(rows))
  assert "1 setting(s) flagged" in text and "2 per-category figure(s)" in text


def test_interrupted_run_keeps_finished_settings_and_resumes(tmp_path, monkeypatch):
  from experiments import experiment, progress
  from experiments.measure import Bench
  timed = []
  real = Bench._timed

  def record(self, draft, temperature, settings, **kw):
    timed.append((temperature, tuple(g for g, _, _ in settings)))
    return real(self, draft, temperature, settings, **kw)

  def interrupt_second(self, draft, temperature, settings, **kw):
    if len(timed) == 1:
      raise KeyboardInterrupt
    return record(self, draft, temperature, settings, **kw)

  monkeypatch.setattr(Bench, "_timed", interrupt_second)
  with pytest.raises(KeyboardInterrupt):
    experiment.run(_two_gamma_config(tmp_path))
  lines = (tmp_path / progress.LOG_NAME).read_text().splitlines()
  assert timed == [(0.0, (1, 2))]  # the γs of one temperature are measured together
  assert [json.loads(line)["run"]["gamma"] for line in lines[1:]] == [1, 2]  # header + T = 0

  timed.clear()
  monkeypatch.setattr(Bench, "_timed", record)
  results = experiment.run(_two_gamma_config(tmp_path))
  assert timed == [(1.0, (1, 2))]  # T = 0 came from the log
  assert results["reused_settings"] == 2
  assert sorted((r["gamma"], r["temperature"]) for r in results["rows"]
                if r["category"] == "all") == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
  assert len((tmp_path / progress.LOG_NAME).read_text().splitlines()) == 5

  timed.clear()  # another config in the same --out starts over and keeps the old log
  experiment.run(dataclasses.replace(_two_gamma_config(tmp_path), gammas=(1,)))
  assert timed == [(0.0, (1,)), (1.0, (1,))] and (tmp_path / "progress.1.jsonl").exists()


def test_settings_of_one_temperature_share_one_plain_baseline_per_round(tmp_path, monkeypatch):
  import specjax
  from experiments import experiment
  monkeypatch.setattr("experiments.measure.run_flags", lambda run, **_: [])  # no re-measuring
  calls, real, real_spec = [], specjax.generate, SpeculativeDecoder.generate
  monkeypatch.setattr(specjax, "generate",
                      lambda *a, **k: calls.append(("plain", a[3])) or real(*a, **k))
  monkeypatch.setattr(SpeculativeDecoder, "generate", lambda self, *a, **k: calls.append(
      (f"γ={self.gamma}", a[3])) or real_spec(self, *a, **k))
  results = experiment.run(dataclasses.replace(_two_gamma_config(tmp_path), repeats=3))
  # per temperature: the compiling call, then per round the one batch (prefill and loop
  # times come from each call itself)
  assert [n for who, n in calls if who == "plain"] == [1] + [4] * 3 + [1] + [4] * 3
  # The batch's calls (4 tokens) rotate from round to round, so no setting always runs
  # first: rounds of (plain, γ=1, γ=2) in turn, per temperature.
  batch_calls = [who for who, n in calls if n == 4]
  assert batch_calls == 2 * ["plain", "γ=1", "γ=2", "γ=1", "γ=2", "plain",
                             "γ=2", "plain", "γ=1"]
  for t in (0.0, 1.0):
    runs = [r for r in results["runs"] if r["temperature"] == t]
    assert sorted(r["gamma"] for r in runs) == [1, 2]
    assert runs[0]["plain_seconds"] == runs[1]["plain_seconds"]  # the same timed calls
    assert runs[0]["seconds"] != runs[1]["seconds"]


def test_progress_log_ignores_a_line_cut_off_mid_write(tmp_path):
  from experiments import progress
  head = progress.header(ExperimentConfig(out=str(tmp_path)), "abc")
  log = progress.ProgressLog(str(tmp_path), head)
  log.append({"run": {"gamma": 1}})
  with open(log.path, "a") as f:
    f.write('{"run": {"gam')
  assert progress.ProgressLog(str(tmp_path), head).records == [{"run": {"gamma": 1}}]
  # --fresh or another commit: start over
  assert progress.ProgressLog(str(tmp_path), head, fresh=True).records == []


def test_a_resumed_run_reuses_its_logged_calibrations(tmp_path, monkeypatch):
  """Bench.calibrate and Bench.chain_rates log what they measure; a Bench started from the
  resumed log returns the same values (JSON-normalised, as the first Bench returned them)
  without decoding again, while another temperature, prompt set or depth is measured, and so
  is another evidence (a log whose calibrations were counted otherwise is not reused)."""
  import dataclasses
  from experiments import measure, progress
  from experiments.measure import Bench
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts, make_batches
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=2, max_new_tokens=6,
                            out=str(tmp_path), calibration_tree=(2, 1))
  target = load_target("tiny")
  draft = load_draft("tiny", target, lambda: [])
  batches = make_batches(default_prompts(2), target.encode, 1)
  prompts = [target.encode(t) for t in ("one two", "three four five")]
  calls = []
  for name in ("measure_chain_alphas", "measure_tree_prices"):
    real = getattr(measure, name)
    monkeypatch.setattr(measure, name, lambda *a, real=real, name=name, **k:
                        calls.append((name, k.get("evidence"))) or real(*a, **k))
  head = progress.header(config, "abc")
  first = Bench(target, batches, config, progress.ProgressLog(str(tmp_path), head))
  rates, prices = first.chain_rates(draft, 1.0, prompts, 2), first.calibrate(draft, 1.0, prompts)
  assert calls == [("measure_chain_alphas", "expected"), ("measure_tree_prices", "expected")]
  assert isinstance(rates[0], float) and len(rates[1]) == 2
  assert isinstance(prices["table"], list) and len(prices["table"]) == 2  # depth of (2, 1)
  json.dumps(prices)  # all of it goes to the log as it is
  assert first.chain_rates(draft, 1.0, prompts, 2) == rates and len(calls) == 2
  resumed = Bench(target, batches, config, progress.ProgressLog(str(tmp_path), head))
  assert resumed.chain_rates(draft, 1.0, prompts, 2) == rates
  assert resumed.calibrate(draft, 1.0, prompts) == prices and len(calls) == 2
  resumed.chain_rates(draft, 0.0, prompts, 2)           # another temperature,
  resumed.chain_rates(draft, 1.0, prompts[:1], 2)       # other prompts,
  resumed.chain_rates(draft, 1.0, prompts, 3)           # a deeper chain: measured
  assert calls[2:] == [("measure_chain_alphas", "expected")] * 3
  lines = [json.loads(line) for line in open(first.log.path)]
  assert sum("calibration" in line for line in lines) == 5 and resumed.reused == 0
  # The same log read by a run that counts outcomes: its calibrations are measured again.
  outcomes = dataclasses.replace(config, evidence="accepted")
  counted = Bench(target, batches, outcomes, progress.ProgressLog(str(tmp_path), head))
  counted.chain_rates(draft, 1.0, prompts, 2), counted.calibrate(draft, 1.0, prompts)
  assert calls[5:] == [("measure_chain_alphas", "accepted"), ("measure_tree_prices", "accepted")]


def test_untimed_greedy_runs_are_replayed_with_the_real_runs_tokens_and_counters(tmp_path):
  import numpy as np
  from experiments.measure import Bench, _spec_outputs
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts, make_batches
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=5, max_new_tokens=6,
                            out=str(tmp_path))
  target = load_target("tiny")
  bench = Bench(target, make_batches(default_prompts(5), target.encode, 1), config)
  draft = load_draft("tiny", target, lambda: [])
  greedy, sampled = (bench.spec_many(draft, [(3, None)], t, timed=False)[0] for t in (0.0, 1.0))
  assert greedy.replayed and not sampled.replayed
  dec = bench.decoder(draft, 3, 0.0)
  real = _spec_outputs([dec.generate(target.params, draft.params, b.ids, 6,
                                     cache_size=bench.cache_size)
                        for b in bench.untimed_batches], bench.untimed_batches)
  assert greedy.generated == real["generated"] and greedy.steps == real["steps"]
  for got, want in zip(greedy.counters, real["counters"]):
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.heavy  # 81 s
def test_untimed_runs_in_two_threads_log_what_one_thread_logs(tmp_path, monkeypatch):
  """Bench.untimed_many (the Table-3 α runs, config.workers at a time) stores and logs each
  job's run in job order, with the tokens and counters of one run at a time; the greedy
  continuations the replayed jobs share are computed once, before the threads start; jobs
  already run are skipped. --workers changes nothing a resumed run must match."""
  import threading
  from experiments import progress
  from experiments.measure import Bench
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts, make_batches
  target = load_target("tiny")
  batches = make_batches(default_prompts(4), target.encode, 1)
  drafts = [load_draft(n, target, lambda: [[1, 2, 3, 1, 2]]) for n in ("tiny", "bigram")]
  jobs = [(d, g, None, t) for d in drafts for g in (2, 3) for t in (0.0, 1.0)]
  logs, threads = {}, {}
  for workers in (1, 2):
    config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=4, max_new_tokens=6,
                              out=str(tmp_path / str(workers)), workers=workers)
    os.makedirs(config.out)
    bench = Bench(target, batches, config, progress.ProgressLog(
        config.out, progress.header(config, "abc")))
    real = bench._untimed
    seen = threads[workers] = []  # the threads of each call (each call has its own pool)
    both = []  # per call: set once two threads have entered a job

    def untimed(*a, seen=seen, workers=workers):
      # with the programs compiled by the first pass, a job takes milliseconds and one
      # thread could take them all before the other starts: with two workers, the first
      # job waits for a second thread to enter one (a single-thread pool times out here)
      seen[-1].add(threading.get_ident())
      if workers == 2:
        if len(seen[-1]) == 2:
          both[-1].set()
        both[-1].wait(timeout=30)
      return real(*a)
    monkeypatch.setattr(bench, "_untimed", untimed)
    continuations = []
    real_conts = bench.greedy_continuations
    monkeypatch.setattr(bench, "greedy_continuations",
                        lambda n: continuations.append(n) or real_conts(n))
    seen.append(set()), both.append(threading.Event())
    bench.untimed_many(jobs[:3])
    seen.append(set()), both.append(threading.Event())
    bench.untimed_many(jobs)  # the first three are not run again
    # the longest is asked first (6 new tokens + the deepest replayed chain), so no thread
    # asks for more and computes them again
    assert continuations[0] == 6 + 3 and max(continuations) == 6 + 3
    logs[workers] = [json.loads(line)["run"] for line in list(open(bench.log.path))[1:]]
  # (a second pool's threads may or may not reuse the first's idents: compared per call)
  assert threads[1] == [{threading.get_ident()}] * 2
  assert [len(s) for s in threads[2]] == [2, 2]
  assert [(r["draft"], r["gamma"], r["temperature"]) for r in logs[2]] == [
      (d.name, g, t) for d, g, _, t in jobs]
  assert logs[1] == logs[2]
  assert {r["replayed"] for r in logs[2]} == {True, False}
  one = ExperimentConfig(target="tiny", workers=1)
  assert progress.header(one, "abc") == progress.header(ExperimentConfig(target="tiny"), "abc")
  with pytest.raises(ValueError, match="--workers must be >= 1"):
    ExperimentConfig(target="tiny", workers=0)


def test_a_draft_phase_timed_at_or_below_zero_is_flagged_and_predicts_nothing(tmp_path,
                                                                              monkeypatch):
  """Slopes lost in timer noise can put the fused draft phase's median at or below zero
  (seen with --phase_seconds=0.01 on a busy machine): the draft phase is timed again and
  the setting flagged, and its row has no c or prediction instead of the run stopping in the
  theory's check."""
  from experiments import experiment
  fused = lambda *a, **k: dict(draft=-1e-5, verify=1e-3, draft_samples=[-1e-5, 2e-6] * 4)
  monkeypatch.setattr("experiments.measure.fused_phase_seconds", fused)
  results = experiment.run(dataclasses.replace(_two_gamma_config(tmp_path), gammas=(2,)))
  row = next(r for r in results["rows"] if r["experiment"] == "gamma_sweep"
             and r["category"] == "all")
  assert row["speedup"] is not None and row["alpha"] is not None
  assert row["c"] is None and row["predicted_speedup"] is None
  assert row["c_remeasured"] and any("draft-phase spread" in f for f in row["flags"])


def test_a_disturbed_draft_phase_re_times_c_alone_not_the_settings_rounds(tmp_path,
                                                                         monkeypatch):
  """The draft-phase flag is about c, which the settings of one draft and temperature share:
  it times the draft phase once more (the second kept, the first spread recorded), and no
  setting's interleaved rounds are measured again for it."""
  from experiments import experiment
  calls = []

  def fused(*args, **kwargs):  # the first timing of each temperature disturbed, then steady
    calls.append(1)
    samples = [1e-3, 5e-3] * 4 if len(calls) % 2 else [1e-3, 1.01e-3] * 4
    return dict(draft=float(np.median(samples)), verify=1e-3, draft_samples=samples)

  monkeypatch.setattr("experiments.measure.fused_phase_seconds", fused)
  monkeypatch.setattr("experiments.checks.spread", lambda values: 0.0)  # steady rounds
  monkeypatch.setattr("experiments.measure.costs", lambda run: (0.1, 1.0))  # possible ones
  cfg = _two_gamma_config(tmp_path)
  results = experiment.run(cfg)
  timed = [r for r in results["runs"] if r["seconds"]]
  assert len(calls) == 2 * 2  # twice per sweep temperature, never per setting
  assert all(len(r["seconds"]) == cfg.repeats and not r["first_flags"] for r in timed)
  assert all(r["costs"]["first_draft_spread"] > 0.25 >= r["costs"]["draft_spread"]
             for r in timed)
  rows = [r for r in results["rows"] if r["experiment"] == "gamma_sweep"
          and r["category"] == "all"]
  assert rows and all(r["c_remeasured"] and not r["remeasured"] and not r["flags"]
                      for r in rows)
  text = open(tmp_path / "tables.md").read()
  assert "ok (c re-measured)" in text and "c re-measured for 2 draft/temperature" in text


def test_the_bench_draws_sampled_drafts_at_the_configured_draft_temperature(tmp_path):
  """``--draft_temperature`` reaches every decoder the experiments build: sampled runs draw
  their drafts at that multiple of T (the target's sampler unchanged), greedy runs and the
  default ratio 1 keep the usual rule."""
  from experiments.measure import Bench
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts, make_batches
  from specjax.sampling import Greedy, Sampling
  target = load_target("tiny")
  batches = make_batches(default_prompts(2), target.encode, 1)
  draft = load_draft("tiny", target, lambda: [])
  for ratio, t, want in [(0.5, 1.0, Sampling(0.5)), (0.5, 0.0, None), (1.0, 1.0, None),
                         (0.0, 0.5, Greedy())]:
    config = ExperimentConfig(target="tiny", draft="tiny", out=str(tmp_path),
                              draft_temperature=ratio)
    dec = Bench(target, batches, config).decoder(draft, 2, t)
    assert dec.draft_sampler == want and dec.sampler == (Sampling(t) if t else Greedy())


def test_provenance_without_a_git_binary_says_unknown(monkeypatch):
  """Results headers and a training run's invocation lines name the commit where git runs; on a
  machine without the git binary the commit is unknown (None) instead of the run failing."""
  import subprocess
  from experiments import report

  def missing(*args, **kwargs):
    raise FileNotFoundError(2, "No such file or directory: 'git'")

  monkeypatch.setattr(subprocess, "run", missing)
  assert report.git_revision() == {"commit": None, "dirty": False}
