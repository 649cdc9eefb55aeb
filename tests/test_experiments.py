"""experiments.run on tiny random models: every output file, consistent numbers, prompt checks."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import prompts
from experiments.config import (DRAFT_FREE, ExperimentConfig, parse_trees, setting_tree,
                                sweep_tree, tree_setting)
from experiments.measure import as_tuple, policy_of, tree_shape
from specjax import theory
from specjax.speculative.tree import DynamicTree, SampledDynamicTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW = 8  # max_new_tokens of the smoke run (tests/conftest.py)
FILES = ("results.json", "results.csv", "tables.md", "speedup_vs_gamma.png", "temperature.png",
         "accept_len_hist.png", "verify_cost.png")


def test_smoke_run_writes_every_output_file(smoke):
  _, out = smoke
  for name in FILES:
    assert os.path.getsize(os.path.join(out, name)) > 0, name


def test_results_json_records_config_revision_and_machine(smoke):
  results, out = smoke
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  assert saved["config"]["gammas"] == [2] and saved["config"]["target"] == "tiny"
  assert saved["git"]["commit"]
  assert {"cpu", "cpu_model", "cpu_avx2", "cpu_avx512f", "cores", "jax"} <= set(saved["machine"])
  assert len(saved["load_average_start"]) == 3
  timed = [r for r in saved["runs"] if r["seconds"] is not None]
  assert timed and all(len(r["load_average"]) == 2 for r in timed)
  assert len(saved["rows"]) == len(results["rows"])
  assert {r["experiment"] for r in saved["rows"]} == {"gamma_sweep", "adaptive",
                                                      "temperature_sweep", "drafts_alpha",
                                                      "tree_sweep", "draft_free"}


def test_token_counts_agree_with_accepted_counts(smoke):
  rows = smoke[0]["rows"]
  for r in rows:
    g, hist = r["gamma"], np.asarray(r["accept_len_hist"])  # γ, or a tree's depth D
    steps_at = np.asarray(r["depth_hist"])  # steps at each γ (a fixed shape: all at g)
    assert steps_at.sum() == r["target_calls"]
    if r["shape"] == "adaptive":  # γ varies by step; its plain steps (γ = 0) draft nothing
      drafted_at_depth = (steps_at * np.arange(g + 1)).sum()
      if r["experiment"] == "tree_sweep":  # its trees draft more nodes than their depth
        assert r["drafted"] >= drafted_at_depth
      else:
        assert r["drafted"] == drafted_at_depth
      assert hist.sum() == r["target_calls"] - steps_at[0]
    else:
      assert r["drafted"] == r["num_nodes"] * r["target_calls"]
      assert steps_at[g] == r["target_calls"] == hist.sum()
    assert (hist * np.arange(g + 1)).sum() == r["accepted"]
    # emitted = accepted + one target token per call, minus what the budget cut off
    assert r["accepted"] <= r["emitted"] <= r["accepted"] + r["target_calls"]
    assert r["emitted"] == r["generated_tokens"] == r["prompts"] * NEW  # EOS ignored
    assert r["tokens_per_call"] == pytest.approx(r["emitted"] / r["target_calls"])
    if r["drafted"]:  # an adaptive policy may have taken plain steps only
      assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])
    else:
      assert r["shape"] == "adaptive" and r["acceptance_rate"] is None
    # α = E[β] is defined for chains of sampled drafts only (an adaptive policy's chains
    # included, unless it drafted nothing)
    if r["tree"] is None:
      assert 0.0 <= r["alpha"] <= 1.0
    elif r["shape"] == "adaptive" and r["experiment"] == "tree_sweep":  # None: trees only
      assert r["alpha"] is None or 0.0 <= r["alpha"] <= 1.0
    elif r["shape"] == "adaptive":
      assert r["alpha"] is None if r["drafted"] == 0 else 0.0 <= r["alpha"] <= 1.0
    else:
      assert r["alpha"] is None


def test_speedups_are_medians_of_interleaved_round_ratios(smoke):
  results = smoke[0]
  timed = [r for r in results["rows"] if r["speedup"] is not None]
  assert timed
  for r in timed:
    assert r["ar_generated_tokens"] == r["generated_tokens"]
  for run in results["runs"]:
    if run["seconds"] is None or run["group"]:  # a chain timed beside the adaptive policy:
      continue  # its row is the policy's paired_speedup
    # --repeats=2 rounds, and a third where a speedup spread > 10% over the first two
    # (over every batch, or over some category's only: the others are None)
    assert len(run["seconds"]) == len(run["plain_seconds"]) in (2, 3)
    plain_seconds, seconds = _complete(run, "plain_seconds"), _complete(run, "seconds")
    assert len(seconds) >= 2
    assert run["tokens"] == run["plain_tokens"]  # EOS never stops the tiny model's rows
    ratios = [sum(p) / sum(s) for p, s in zip(plain_seconds, seconds)]
    key = (run["draft"], run["gamma"], run["temperature"], run["tree"])
    overall = [r for r in timed if (r["draft"], r["gamma"], r["temperature"],
                                    r["tree"] and tuple(r["tree"])) == key
               and r["category"] == "all"]
    assert overall
    for r in overall:
      assert r["speedup"] == pytest.approx(np.median(ratios))
      assert r["speedup_spread"] == pytest.approx((max(ratios) - min(ratios)) / np.median(ratios))
      assert r["spec_seconds"] == pytest.approx(np.median([sum(s) for s in seconds]))
      assert r["ar_seconds"] == pytest.approx(np.median([sum(p) for p in plain_seconds]))


def _complete(run, field):
  """``run[field]``'s rounds that timed every batch."""
  return [row for row, spec in zip(run[field], run["seconds"]) if None not in spec]


def test_decode_only_speedups_take_each_calls_prefill_out(smoke):
  results = smoke[0]
  # (a chain timed beside the adaptive policy, in its group, has no row of its own)
  runs = [r for r in results["runs"] if r["seconds"] is not None and not r["group"]]
  assert runs
  for run in runs:
    for total, pre in (("seconds", "prefill_seconds"),
                       ("plain_seconds", "plain_prefill_seconds")):
      for t_row, p_row in zip(run[total], run[pre]):
        assert [t is None for t in t_row] == [p is None for p in p_row]
        assert all(0 < p < t for t, p in zip(t_row, p_row) if t is not None)
    plain, plain_pre, spec, spec_pre = (_complete(run, f) for f in (
        "plain_seconds", "plain_prefill_seconds", "seconds", "prefill_seconds"))
    loop = lambda total, pre: sum(t - p for t, p in zip(total, pre))
    ratios = [loop(p, pp) / loop(s, sp) for p, pp, s, sp in zip(plain, plain_pre, spec, spec_pre)]
    share = [sum(pp) / sum(p) for p, pp in zip(plain, plain_pre)]
    key = (run["draft"], run["gamma"], run["temperature"], run["tree"])
    matched = [r for r in results["rows"]
               if (r["draft"], r["gamma"], r["temperature"], r["tree"] and tuple(r["tree"])) == key
               and r["category"] == "all" and r["speedup"] is not None]
    assert matched
    for r in matched:
      assert r["decode_speedup"] == pytest.approx(np.median(ratios))
      assert r["ar_prefill_share"] == pytest.approx(np.median(share))
    # t₁ and the speculative step: loop seconds over loop steps, pooled over the round
    # (plain decoding takes one step per new token: EOS is ignored); None for a round
    # that left batches out
    steps, plain_steps = sum(run["steps"]), NEW * len(run["steps"])
    full = [None not in row for row in run["seconds"]]
    assert [x is not None for x in run["step_seconds"]] == full
    assert [x is not None for x in run["plain_step_seconds"]] == full
    assert [x for x in run["step_seconds"] if x is not None] == pytest.approx(
        [loop(s, sp) / steps for s, sp in zip(spec, spec_pre)])
    assert [x for x in run["plain_step_seconds"] if x is not None] == pytest.approx(
        [loop(p, pp) / plain_steps for p, pp in zip(plain, plain_pre)])


def test_predictions_follow_the_theory_from_measured_alpha_and_c(smoke):
  predicted = [r for r in smoke[0]["rows"] if r["predicted_speedup"] is not None]
  assert predicted
  for r in predicted:
    assert r["predicted_speedup"] == pytest.approx(
        theory.walltime_improvement(r["alpha"], r["gamma"], r["c"]))
    t1 = r["step_seconds"]
    # verify cost = the measured speculative step minus the draft's share, in target steps
    # (never printed when timer noise on a tiny model makes it <= 0, and then flagged)
    verify = r["spec_step_seconds"] / t1 - r["gamma"] * r["c"]
    if verify <= 0:
      assert r["verify_cost"] is None and r["calibrated_speedup"] is None
      assert any("verify cost" in f for f in r["flags"])
      continue
    assert r["verify_cost"] == pytest.approx(verify)
    # E[tokens] of batches (of 2 here) that wait for their slowest row, between one token a
    # step and γ + 1 (the test below pins the formula); rounding aside, where α is 0 (the
    # random tiny draft on some CPU kinds) it is exactly one
    tokens = r["calibrated_speedup"] * (r["gamma"] * r["c"] + r["verify_cost"])
    assert 1.0 - 1e-9 <= tokens <= r["gamma"] + 1 + 1e-9
    # the whole call: the decode loop as predicted, the prefill as measured
    s, r_p = r["ar_prefill_share"], r["prefill_ratio"]
    assert 0 < s < 1 and r_p > 0
    assert r["calibrated_call_speedup"] == pytest.approx(
        1 / (s / r_p + (1 - s) / r["calibrated_speedup"]))


def test_calibrated_predictions_wait_for_each_batchs_slowest_row():
  """Per batch its rows' own α (padding rows have no counters; a row that drafted nothing
  is left out), the slowest row's E, harmonic over batches; a category keeps its batches."""
  import types
  from experiments import rows
  from experiments.prompts import Batch
  batches = [Batch("code", (0, 1), ((1,), (2,)), ("code", "code")),
             Batch("chat", (2, 3), ((3,), (4,)), ("chat", "chat"))]
  counters = [dict(beta_sum=np.array([3.0, 9.0]), beta_count=np.array([10.0, 10.0])),
              dict(beta_sum=np.array([8.0, 0.0]), beta_count=np.array([10.0, 0.0]))]
  run = types.SimpleNamespace(counters=counters, gamma=2)
  e = lambda a: theory.expected_tokens_per_step(a, 2)
  assert rows.slowest_row_tokens(run, batches, "all") == pytest.approx(
      2 / (1 / e(0.3) + 1 / e(0.8)))
  assert rows.slowest_row_tokens(run, batches, "chat") == pytest.approx(e(0.8))
  # a tree's rows by their measured tokens per call (emitted / target calls)
  for c, emitted, calls in zip(counters, ([30.0, 20.0], [0.0, 0.0]), ([10.0, 10.0], [0.0, 0.0])):
    c.update(emitted=np.array(emitted), target_calls=np.array(calls))
  per_row = rows._per_row(run, batches, "all", "emitted", "target_calls")
  np.testing.assert_allclose(per_row[0], [3.0, 2.0])
  np.testing.assert_allclose(per_row[1], [0.0])  # no row called the target


def test_greedy_speculative_output_equals_plain_greedy(smoke):
  greedy = [r for r in smoke[0]["rows"] if r["greedy_match"] is not None]
  assert greedy and all(r["greedy_match"] == 1.0 for r in greedy)


def test_csv_and_tables(smoke):
  results, out = smoke
  with open(os.path.join(out, "results.csv")) as f:
    assert len(list(csv.DictReader(f))) == len(results["rows"])
  text = open(os.path.join(out, "tables.md")).read()
  for heading in ("Speedup vs γ", "Speedup vs temperature", "α of each draft",
                  "The paper's numbers", "| CNNDM | T5-small | 0 | 5 | 0.65 | 3.1× |",
                  "## Checks", "| spread |", "load average before the run"):
    assert heading in text
  minutes = results["experiment_seconds"]  # where the run's time went, each experiment's
  assert set(minutes) == {"gamma_sweep", "adaptive", "temperature_sweep", "drafts_alpha",
                          "draft_free", "tree_sweep"}
  assert (f"gamma sweep {minutes['gamma_sweep'] / 60:.1f}, adaptive "
          f"{minutes['adaptive'] / 60:.1f}") in text and "start-up, loading and writing" in text
  for r in results["rows"]:
    if r["category"] == "all" and r["flags"]:
      shape = (f"γ = {r['gamma']}" if r["tree"] is None
               else f"{r['shape']} N = {r['num_nodes']}, D = {r['gamma']}")
      assert f"{shape}, T = {r['temperature']:g}: {'; '.join(r['flags'])}" in text


def test_padding_rows_are_left_out_of_statistics(smoke):
  # 3 prompts of 3 categories in batches of 2: every batch has one padding row.
  results = smoke[0]
  assert results["num_prompts"] == 3
  overall = [r for r in results["rows"] if r["category"] == "all"]
  assert all(r["prompts"] == 3 for r in overall)


def test_calibration_prompts_are_held_out_and_never_timed():
  """What prices a policy is text the draft never trained on, as the timed prompts are, and
  none of the timed prompts: the held-out prompts after the first ``timed``."""
  timed = [p.text for p in prompts.default_prompts(8)]
  cal = prompts.calibration_prompts(8, timed=8)
  assert len(cal) == 8 and not set(cal) & set(timed)
  assert cal == [p.text for p in prompts.default_prompts(16)[8:]]
  assert not set(cal) & set(prompts.training_prompts(400))
  assert prompts.calibration_prompts(4, timed=20)[0] != cal[0]  # more timed: later ones
  held = len(prompts.default_prompts(10_000))
  with pytest.raises(ValueError, match=f"need {held + 1} held-out prompts; there are {held}$"):
    prompts.calibration_prompts(8, timed=held - 7)


# ------------------------------------------------------------------ --prompts validation


def _write(tmp_path, text):
  path = tmp_path / "p.jsonl"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "hi", "category": "chat"}\n{"prompt": "x",\n', "line 2: malformed JSON"),
    ('{"prompt": "hi"}\n\n{"prompt": "   ", "category": "qa"}\n', "line 3: empty prompt"),
    ('{"category": "qa"}\n', 'line 1: missing required key "prompt"'),
    ('{"prompt": "a"}\n["prompt"]\n', "line 2: expected a JSON object"),
    ('{"prompt": 3}\n', 'line 1: "prompt" must be a string'),
    ("\n\n", "has no prompts"),
])
def test_prompt_file_errors_name_the_line(tmp_path, text, message):
  with pytest.raises(prompts.PromptFileError, match=message):
    prompts.load_prompt_file(_write(tmp_path, text))


def test_missing_prompt_file(tmp_path):
  with pytest.raises(prompts.PromptFileError, match="does not exist"):
    prompts.load_prompt_file(str(tmp_path / "nope.jsonl"))


def test_prompt_file_loads_categories(tmp_path):
  items = prompts.load_prompt_file(_write(
      tmp_path, '{"prompt": "a", "category": "code"}\n{"prompt": "b"}\n'))
  assert [(p.text, p.category) for p in items] == [("a", "code"), ("b", "uncategorised")]


def test_cli_reports_a_bad_prompt_file_before_loading_models(tmp_path):
  path = _write(tmp_path, '{"prompt": "ok"}\n{"prompt": ""}\n')
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--target=tiny",
                         f"--prompts={path}", f"--out={tmp_path / 'out'}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "line 2: empty prompt" in proc.stderr
  assert not (tmp_path / "out").exists()


def test_batches_are_category_pure_and_padded():
  items = [prompts.PromptItem("aa", "x"), prompts.PromptItem("b", "y"),
           prompts.PromptItem("ccc", "x"), prompts.PromptItem("dddd", "x")]
  batches = prompts.make_batches(items, lambda t: [ord(ch) for ch in t], 2)
  assert [(b.category, b.index) for b in batches] == [("x", (0, 2)), ("x", (3,)), ("y", (1,))]
  assert all(len(b.ids) == 2 for b in batches)
  assert batches[1].ids[1] == batches[1].ids[0]


def test_untimed_batches_group_rows_by_prompt_length():
  items = [prompts.PromptItem(t, c) for t, c in
           [("a" * 5, "x"), ("b" * 90, "y"), ("c" * 6, "y"), ("d" * 80, "x"), ("e" * 7, "z")]]
  batches = prompts.make_batches(items, lambda t: [ord(ch) for ch in t], 2)
  merged = prompts.merge_batches(batches, max_rows=2)
  assert [b.index for b in merged] == [(0, 2), (4, 3), (1,)]
  assert [b.row_categories for b in merged] == [("x", "y"), ("z", "x"), ("y",)]
  assert sorted(i for b in merged for i in b.index) == list(range(5))  # every row, once
  assert [len(ids) for ids in merged[2].ids] == [90, 90]  # padded with a real row


@pytest.fixture
def fresh_split():
  """The built-in prompt split forgotten before and after the test (it is built once per
  process), so a test's stand-in prompts never reach another test."""
  prompts._split.cache_clear()
  yield
  prompts._split.cache_clear()


def test_builtin_prompts_are_built_once_then_read_from_the_disk_cache(tmp_path, monkeypatch,
                                                                        fresh_split):
  from specjax.distill import data
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  made = [data.Prompt(c, f"{c}:{i}", f"{c} prompt {i}") for i in range(40)
          for c in data.CATEGORIES]
  builds = []
  monkeypatch.setattr(data, "build_prompts", lambda seed: builds.append(seed) or made)
  want = data.split_by_source(made)
  assert want[1] and prompts._split() == want and builds == [0]
  path = prompts._split_cache_path()
  assert os.path.dirname(path) == str(tmp_path / "prompts")
  prompts._split.cache_clear()  # a new process: read from disk, nothing built
  assert prompts._split() == want and builds == [0]
  assert [p.text for p in prompts.default_prompts(3)] == [
      p.text for p in data.interleave_categories(want[1])[:3]]
  with open(path, "w") as f:  # a write cut off: rebuilt, not an error
    f.write('[[{"category": "co')
  prompts._split.cache_clear()
  assert prompts._split() == want and builds == [0, 0]
  monkeypatch.setattr(prompts.sys, "version", "another build")  # another Python: its own file
  assert prompts._split_cache_path() != path


@pytest.mark.parametrize("kwargs, message", [
    (dict(gammas=(0,)), "--gammas must be integers >= 1"),
    (dict(gammas=(2, 2)), "--gammas lists a value twice"),
    (dict(experiments=("nope",)), "unknown experiments"),
    (dict(repeats=0), "--repeats must be >= 1"),
    (dict(extra_rounds=-1), "--extra_rounds must be >= 0"),
    (dict(phase_seconds=0.0), "--phase_seconds must be a finite number > 0, got 0.0"),
    (dict(phase_seconds=float("nan")), "--phase_seconds must be a finite number > 0"),
    (dict(num_prompts=0), "--num_prompts must be >= 1"),
    (dict(experiments=("tree_sweep",), num_prompts=100_000),
     "--calibration_prompts=8: 8 calibration prompts after the 100000 timed ones need"),
    (dict(batch_size=2, num_prompts=100_000),  # the default experiments, adaptive among them
     "--calibration_prompts=8: 8 calibration prompts after the 100000 timed ones need"),
    (dict(temperatures=(0.0, float("inf"))), r"--temperatures must be finite numbers >= 0, "
                                             r"got \[inf\]"),
    (dict(temperatures=(float("nan"),)), "--temperatures must be finite"),
    (dict(temperatures=(-1.0,)), "--temperatures must be finite numbers >= 0"),
    (dict(draft="early_exit:0"), "--draft: 'early_exit:0': K of early_exit:K must be an integer"),
    (dict(draft="early_exit:x"), "K of early_exit:K must be an integer >= 1"),
    (dict(draft="/no/such/draft"), "--draft: '/no/such/draft' is neither a draft name"),
    (dict(alpha_drafts=("trigram",)), "--alpha_drafts: 'trigram' is neither"),
    (dict(alpha_drafts=("bigram", "bigram")), "--alpha_drafts lists a value twice"),
    (dict(draft_free_drafts=("jacobi", "unigram", "eagle")),
     "--draft_free_drafts: 'unigram', 'eagle' are not among the methods without a draft model"),
    (dict(draft_free_drafts=("jacobi", "jacobi")), "--draft_free_drafts lists a value twice"),
    (dict(experiments=("draft_free",), draft_free_drafts=()),
     "--experiment=draft_free has nothing to time: --draft_free_drafts is empty and "
     "--draft=eagle has a draft model"),
    (dict(verification="joint"), "--verification must be one of"),
    (dict(min_gain=-0.01), "--min_gain must be a finite number >= 0"),
    (dict(min_gain=float("nan")), "--min_gain must be a finite number >= 0"),
    (dict(min_gain=True), "--min_gain must be a finite number >= 0"),
    (dict(evidence="outcomes"), "--evidence must be one of expected, accepted, got 'outcomes'"),
    (dict(draft_temperature=-0.5), "--draft_temperature must be a finite number >= 0"),
    (dict(draft_temperature=float("nan")), "--draft_temperature must be a finite number >= 0"),
    (dict(draft_temperature=1e-6), r"--draft_temperature=1e-06 at T = 0.5: temperature must be"),
    (dict(draft="lookahead"), "--draft=lookahead verifies its own tree, so it has no γ for "
                              "adaptive, gamma_sweep, temperature_sweep"),
    (dict(sweep_trees=("4:4:3",)), "--sweep_trees: 4:4:3: DynamicTree num_nodes=3 < depth=4"),
    (dict(sweep_trees=("2:2:7",)), "--sweep_trees: 2:2:7: .*exceeds the 6 candidates"),
    (dict(sweep_trees=("0:2:2",)), "--sweep_trees: 0:2:2: DynamicTree top_k must be"),
    (dict(sweep_trees=("4:4",)), "--sweep_trees: 4:4: '4:4' is neither top_k:depth:nodes"),
    (dict(sweep_trees=("sampled:2:0",)), "--sweep_trees: sampled:2:0: SampledDynamicTree "
                                         "widths must be"),
    (dict(sweep_trees=("4:4:4@0.5",)), "--sweep_trees: 4:4:4@0.5: '4:4:4@0.5': @T must be one "
                                       "of the sweep's temperatures, 0 or 1"),
    (dict(sweep_trees=("4:4:4", "4:4:4")), "--sweep_trees: 4:4:4 times the same tree twice at "
                                           "T = 0"),
    (dict(sweep_trees=("4:4:4", "4:4:4@1")), "--sweep_trees: 4:4:4@1 times the same tree twice "
                                             "at T = 1"),
    (dict(draft="jacobi+lookup"), "--draft: 'jacobi\\+lookup': \\+lookup adds prompt lookup to a "
                                  "draft model; 'jacobi' is not one"),
    (dict(draft="eagle+lookup+lookup"), "'eagle\\+lookup' is not one"),
    (dict(alpha_drafts=("+lookup",)), "--alpha_drafts: '\\+lookup': .*'nothing' is not one"),
    (dict(draft="nonesuch+lookup"), "--draft: 'nonesuch' is neither a draft name"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ExperimentConfig(**kwargs)


def test_config_accepts_draft_names_paths_and_early_exit(tmp_path):
  for spec in ("default", "eagle", "bigram", "early_exit", "early_exit:3", str(tmp_path),
               "eagle+lookup", "early_exit:3+lookup", str(tmp_path) + "+lookup"):
    ExperimentConfig(draft=spec)


def test_a_lookup_suffix_wraps_the_draft_in_a_hybrid_drafter():
  from experiments import models
  from specjax.drafters import HybridDrafter
  target = models.load_target("tiny")
  base = models.load_draft("tiny", target, lambda: [])
  d = models.load_draft("tiny+lookup", target, lambda: [])
  assert isinstance(d.drafter, HybridDrafter) and d.drafter.model == base.drafter
  assert d.name == "tiny+lookup" and d.drafter.lookup.min_ngram == 3
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), d.params,
                                   base.params))


def test_an_unknown_draft_lists_every_name():
  from experiments import models
  from experiments.config import DRAFT_NAMES
  with pytest.raises(ValueError, match="unknown --draft 'nonesuch'") as e:
    models.load_draft("nonesuch", models.load_target("tiny"), lambda: [])
  assert all(name in str(e.value) for name in DRAFT_NAMES)


def test_num_prompts_beyond_the_builtin_set_is_refused():
  with pytest.raises(prompts.PromptFileError, match="--num_prompts=100000: the built-in"):
    prompts.load_items(None, 100_000)


def test_early_exit_beyond_the_target_layers_names_the_flag(tmp_path):
  from experiments import experiment, models
  config = ExperimentConfig(target="tiny", draft="early_exit:99", out=str(tmp_path))
  with pytest.raises(experiment.DraftError, match="--draft=early_exit:99: .*num_layers"):
    experiment.load_drafts(config, models.load_target("tiny"), lambda: [])


def test_each_experiment_gets_its_own_drafts_each_loaded_once(tmp_path):
  """drafts_alpha measures --alpha_drafts beside --draft; draft_free times
  --draft_free_drafts and --draft when it has no draft model; a method in both is one object,
  and an experiment that does not run loads nothing."""
  from experiments import experiment, models
  target = models.load_target("tiny")
  config = ExperimentConfig(target="tiny", draft="jacobi", out=str(tmp_path),
                            experiments=("drafts_alpha", "draft_free"),
                            alpha_drafts=("prompt_lookup", "tiny", "jacobi"),
                            draft_free_drafts=("lookahead", "prompt_lookup"))
  draft, table3, free = experiment.load_drafts(config, target, lambda: [])
  assert draft.name == "jacobi"
  assert [d.name for d in table3] == ["prompt_lookup", "tiny"]  # --draft has its own row
  assert [d.name for d in free] == ["lookahead", "prompt_lookup", "jacobi"]
  assert free[1] is table3[0] and free[2] is draft
  only_alpha = dataclasses.replace(config, experiments=("drafts_alpha",))
  assert experiment.load_drafts(only_alpha, target, lambda: [])[2] == []
  only_free = dataclasses.replace(config, experiments=("draft_free",), draft="tiny")
  _, table3, free = experiment.load_drafts(only_free, target, lambda: [])
  assert table3 == [] and [d.name for d in free] == ["lookahead", "prompt_lookup"]
  exit_k = dataclasses.replace(config, draft="early_exit:1", early_exit_layers=1,
                               alpha_drafts=("early_exit", "early_exit:1", "tiny"))
  draft, table3, _ = experiment.load_drafts(exit_k, target, lambda: [])
  assert draft.name == "early_exit:1" and [d.name for d in table3] == ["tiny"]  # one exit


def test_lookahead_is_timed_by_draft_free_not_the_default_table3():
  """Its 29-node tree is the slowest of the default run's α rows, so the default Table 3
  leaves it out; draft_free times it."""
  config = ExperimentConfig()
  assert "lookahead" not in config.alpha_drafts
  assert "lookahead" in config.draft_free_drafts
  assert set(config.draft_free_drafts) <= set(DRAFT_FREE)


# ------------------------------------------------------------------ checks (flagging rule)


# ------------------------------------------------------------------ outputs: probe, log, resume


def test_unwritable_out_fails_before_any_model_loads(tmp_path, monkeypatch):
  from experiments.machine import OutputError
  from experiments import experiment

  def no_load(source):
    raise AssertionError("a model was loaded")

  monkeypatch.setattr(experiment, "load_target", no_load)
  (tmp_path / "file").write_text("")
  config = ExperimentConfig(target="tiny", draft="tiny", out=str(tmp_path / "file" / "out"))
  with pytest.raises(OutputError, match="--out .*file/out' cannot be written"):
    experiment.run(config)


@pytest.mark.parametrize("args, message", [
    (["--out={tmp}/file/out"], "cannot be written"),
    (["--temperatures=0,inf"], "--temperatures must be finite numbers >= 0, got [inf]"),
    (["--draft=early_exit:0"], "K of early_exit:K must be an integer >= 1"),
    (["--min_gain=-0.5"], "--min_gain must be a finite number >= 0, got -0.5"),
    (["--evidence=beta"], "--evidence"),
    (["--experiment=draft_free", "--draft_free_drafts=jacobi,bigram"],
     "--draft_free_drafts: 'bigram' is not among the methods without a draft model"),
    (["--draft_temperature=-1"], "--draft_temperature must be a finite number >= 0 (a multiple of "
                                 "the target's temperature), got -1.0"),
])
def test_cli_rejects_bad_flags_before_loading_models(tmp_path, args, message):
  (tmp_path / "file").write_text("")
  args = [a.format(tmp=tmp_path) for a in args]
  proc = subprocess.run([sys.executable, "-m", "experiments.run", *args] +
                        ([] if any(a.startswith("--out") for a in args)
                         else [f"--out={tmp_path / 'out'}"]),
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert message in proc.stderr
  assert "loading target" not in proc.stderr


def test_peer_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  refused("benchmarks.peer",
          (["--gamma", "0"], "flag --gamma=0"),
          (["--num_prompts", "0"], "flag --num_prompts=0"),
          ([f"--out={tmp_path}"], "is a directory"))


def test_draft_temperature_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  (tmp_path / "file").write_text("")
  refused("benchmarks.draft_temperature",
          (["--temperatures=0,1"], "--temperatures must be > 0"),
          (["--ratios=-1"], "--ratios must list numbers >= 0"),
          (["--ratios=1e-6"], "--ratios=1e-06 at T = 0.5: temperature must be"),
          (["--gamma=0"], "--gamma must be >= 1"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_hybrid_lookup_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  (tmp_path / "file").write_text("")
  refused("benchmarks.hybrid_lookup",
          (["--min_matches=0,3"], "--min_matches must list integers >= 1"),
          (["--min_matches=3,3"], "--min_matches lists a value twice"),
          (["--temperatures=-1"], "--temperatures must list numbers >= 0"),
          (["--gamma=0"], "--gamma must be >= 1"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_sampled_trees_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  (tmp_path / "file").write_text("")
  refused("benchmarks.sampled_trees",
          (["--temperatures=-1"], "--temperatures must list numbers >= 0"),
          (["--prompts=0"], "--prompts must be >= 1"),
          (["--sets=eval"], "--sets must list some of"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_draft_panels_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  (tmp_path / "file").write_text("")
  refused("benchmarks.draft_panels",
          (["--temperatures=-1"], "--temperatures must list numbers >= 0"),
          (["--temperatures=x"], "--temperatures takes numbers"),
          (["--prompts=0"], "flag --prompts=0"), (["--new_tokens=1"], "flag --new_tokens=1"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_step_profile_benchmark_rejects_bad_flags_before_loading(tmp_path, refused):
  (tmp_path / "file").write_text("")
  refused("benchmarks.step_profile",
          (["--temperatures=-1"], "--temperatures must list numbers >= 0"),
          (["--methods=chain:x"], "--methods: 'chain:x'"),
          (["--methods=tree:4"], "is not plain, chain:γ, dynamic:k:D:N"),
          (["--methods=chain:0"], "--methods: 'chain:0'"),
          (["--prompts=0"], "flag --prompts=0"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_op_profile_counts_a_loop_thunk_without_the_thunks_nested_in_it():
  from types import SimpleNamespace
  from benchmarks.common import _exclusive_ns

  def ev(op, start, dur, module="jit_run"):
    return SimpleNamespace(name=op, start_ns=start, duration_ns=dur,
                           stats=[("hlo_op", op), ("hlo_module", module)])
  events = [ev("while.1", 0, 100), ev("dot", 10, 30), ev("while.2", 50, 40), ev("add", 60, 5),
            ev("exp", 120, 7), ev("prefill_op", 200, 50, module="jit_prefill"),
            SimpleNamespace(name="end: dot", start_ns=40, duration_ns=1, stats=[])]
  assert _exclusive_ns(events, "jit_run") == {"while.1": 30, "dot": 30, "while.2": 35,
                                              "add": 5, "exp": 7}
  assert _exclusive_ns(events, None)["prefill_op"] == 50


def test_bandwidth_spells_splits_rounds_at_the_midpoint_and_refuses_bad_flags(tmp_path, refused):
  from benchmarks.common import split_spells
  t1 = np.array([9.5, 9.6, 13.9, 9.4, 14.1, 13.8] * 5) * 1e-3
  fast, threshold = split_spells(t1)
  assert fast.tolist() == [True, True, False, True, False, False] * 5
  assert 9.6e-3 < threshold < 13.8e-3
  (tmp_path / "file").write_text("")
  refused("benchmarks.bandwidth_spells",
          (["--tokens=0,2"], "--tokens must list integers >= 1"),
          (["--seconds=0"], "flag --seconds=0"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_kernel_ab_refuses_bad_flags_before_building(tmp_path, refused):
  src = "specjax/kernels/streaming_matmul.cc"
  old = tmp_path / "old.cc"  # a source from before the prefetch modes
  old.write_text(open(src).read().replace("kPrefetchNta", "kPrefetchNone"))
  refused("benchmarks.kernel_ab",
          ([], "--sources needs at least one"),
          (["--sources=/nonexistent.cc"], "no such source"),
          ([f"--sources={src}", "--rows=0,2"], "--rows must list integers >= 1"),
          ([f"--sources={src}", "--rows=a"], "--rows must list integers >= 1"),
          ([f"--sources={src}", "--seconds=0"], "flag --seconds=0"),
          ([f"--sources={src},{old}:nta"], "has no non-temporal mode"))


def test_prefetch_modes_benchmark_edits_only_the_policy_and_refuses_bad_flags(
    tmp_path, benchmark_module, refused):
  bench = benchmark_module("prefetch_modes")  # its flags share names with other benchmarks'
  EDITS, with_prefetch = bench.EDITS, bench.with_prefetch
  from specjax.kernels import packed as pk
  from specjax.kernels import policy as pol
  policy = pol.MatmulPolicy(grid=(1, 4, 8), kernel=(True, True, True), prefetch=(2, 0, 2))
  w = pk.pack(np.ones((8, 64), np.float32), policy, keep_plain=False)
  params = {"layers": [{"wqkv": w}], "norm": np.ones(3)}
  modes = {a: with_prefetch(params, e)["layers"][0]["wqkv"].policy.prefetch
           for a, e in EDITS.items()}
  assert modes == {"measured": (2, 0, 2), "l2": (1, 0, 1), "m1_off": (0, 0, 2), "off": ()}
  edited = with_prefetch(params, EDITS["l2"])
  assert edited["layers"][0]["wqkv"].panels is w.panels and edited["norm"] is params["norm"]
  (tmp_path / "file").write_text("")
  refused("benchmarks.prefetch_modes",
          (["--arms=fast"], "--arms: unknown fast"),
          (["--tokens=0"], "--tokens must list integers >= 1"),
          (["--seconds=0"], "flag --seconds=0"),
          ([f"--out={tmp_path}/file/x.md"], "cannot be written"))


def test_kernel_ab_reports_each_spell_apart():
  from benchmarks.common import spell_tables
  # Rounds alternate between a fast (M = 1 at 9-10 ms) and a slow (14 ms) spell; version 1
  # is 10% faster at M = 4 in the fast spell only.
  fast = np.arange(40) % 3 == 0
  runs = {(1, 0): np.where(fast, 9e-3, 14e-3), (1, 1): np.where(fast, 9e-3, 14e-3),
          (4, 0): np.where(fast, 11e-3, 14.5e-3), (4, 1): np.where(fast, 9.9e-3, 14.5e-3)}
  lines = spell_tables(runs, [1, 4], ["a", "b"], 1e9, spells=True)
  text = "\n".join(lines)
  assert "## Fast spell (14 rounds)" in text and "## Slow spell (26 rounds)" in text
  fast_part, slow_part = text.split("## Slow spell")
  assert "| 4 | 11.0 [11.0, 11.0] | 9.9 [9.9, 9.9] | 0.90 |" in fast_part
  assert "| 4 | 14.5 [14.5, 14.5] | 14.5 [14.5, 14.5] | 1.00 |" in slow_part
  whole = "\n".join(spell_tables(runs, [1, 4], ["a", "b"], 1e9, spells=False))
  assert "spell" not in whole and whole.count("| 4 |") == 1


def test_continuous_batching_benchmark_rejects_bad_flags_before_loading(refused):
  refused("benchmarks.continuous_batching",
          (["--slots=0"], "slot counts must be >= 1"),
          (["--budget_spread=2"], "flag --budget_spread=2"),
          (["--prefill_chunk=0"], "flag --prefill_chunk=0"))


def test_tree_attention_benchmark_rejects_bad_shapes_before_timing(refused):
  refused("benchmarks.tree_attention",
          (["--trees=1,64", "--sizes=32"], "must be <= every S of --sizes"),
          (["--trees=256"], "budget of 128 new tokens"),
          (["--batch_sizes=0"], "--batch_sizes must list integers >= 1"),
          (["--trees="], "--trees must list integers >= 1"),
          (["--layers=0"], "flag --layers=0"),
          (["--trees=a"], "--trees takes integers"))


def test_attention_dispatch_benchmark_rejects_bad_flags_before_building(refused):
  refused("benchmarks.attention_dispatch",
          (["--impls=cpu,cpu"], "two different implementations"),
          (["--impls=reference"], "takes two implementations"),
          (["--impls=auto,reference"], "'auto' is what is being chosen"),
          (["--impls=pallas,reference"], "no Pallas attention kernel for backend"),
          (["--contexts=0"], "integers >= 1"),
          (["--tokens="], "--tokens must list integers >= 1"),
          (["--repeats=0"], "flag --repeats=0"),
          (["--tokens=x"], "--tokens takes integers"))


def test_exact_sharding_benchmark_rejects_bad_flags_before_loading(refused):
  refused("benchmarks.exact_sharding",
          (["--meshes=3x3"], "needs 9 devices"),
          (["--meshes=2"], "want DATAxMODEL"),
          (["--meshes=2x1", "--batch=3"], "does not divide"),
          (["--repeats=0"], "--repeats must be >= 1"))


def test_roofline_benchmark_rejects_bad_flags_before_loading(refused):
  refused("benchmarks.roofline",
          (["--tokens=2,4"], "--tokens must include 1"),
          (["--tokens=0,1"], "--tokens must list integers >= 1"),
          (["--context=-1"], "--context must be >= 0"),
          (["--repeats=0"], "--repeats must be >= 1"),
          (["--bandwidth_mib=0"], "--bandwidth_mib must be >= 1"))


def test_roofline_counts_every_weight_once(benchmark_module):
  roofline = benchmark_module("roofline")
  from benchmarks.shapes import SHAPES
  from specjax.model import init_params
  # the matrices a forward multiplies by, counted from real parameters: every 2-D leaf (the
  # layers' projections, and the embedding read whole as the tied LM head)
  tiny = dataclasses.replace(SHAPES["tiny"], tie_embeddings=True)
  leaves = jax.tree_util.tree_leaves(init_params(tiny, jax.random.PRNGKey(0)))
  matrices = sum(x.size for x in leaves if x.ndim >= 2)
  assert roofline.matrix_params(tiny) == matrices, (roofline.matrix_params(tiny), matrices)
  assert roofline.matrix_params(SHAPES["smollm2_135m"]) == 134_479_872
  for cfg in (SHAPES["smollm2_135m"], dataclasses.replace(SHAPES["smollm2_135m"],
                                                          tie_embeddings=False)):
    norms = (2 * cfg.num_layers + 1) * cfg.dim
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # an embedding read by rows
    assert roofline.matrix_params(cfg) + norms + lookup == cfg.num_params
    # T tokens read the weights once: bytes grow only by the embedding rows and the cache.
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    assert (roofline.forward_bytes(cfg, 5, 200) - roofline.forward_bytes(cfg, 1, 200)
            == 4 * 4 * (cfg.dim + 2 * kv))
    # without context the matrices' 2 flops per parameter and token dominate, quadratic rest
    matmul = 2 * roofline.matrix_params(cfg)
    assert roofline.forward_flops(cfg, 3, 0) - 3 * matmul == 9 * (
        roofline.forward_flops(cfg, 1, 0) - matmul)
  assert roofline.roofline_seconds(8e9, 1e9, 4e9, 1e9) == (2.0, "memory")
  assert roofline.roofline_seconds(1e9, 3e9, 1e9, 1e9) == (3.0, "compute")


def test_roofline_benchmark_runs_on_a_tiny_model(tmp_path):
  out = tmp_path / "roofline.md"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--target=tiny",
                         "--tokens=1,2,5", "--repeats=2", "--bandwidth_mib=8", f"--out={out}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = out.read_text()
  roofline, profile = text.split("Where a forward's time goes")
  rows = [l for l in roofline.splitlines() if l.startswith("| ") and l[2].isdigit()]
  assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 2", "| 5"], rows
  assert rows[0].endswith("| 1.00 | 1.00 | 1.00 |")  # T = 1 is the unit of both costs
  assert "GB/s" in text and "GFLOP/s" in text and "Verify of T = 2–5 tokens" in text
  # the profile's table: a row per T, attention's custom call named, a positive total
  profile = profile.splitlines()
  header = next(l for l in profile if l.startswith("| T |"))
  from specjax.kernels import cpu_attention
  assert "XLA ops" in header, header
  assert ("CPU attention kernel" in header) == cpu_attention.available(), header
  totals = [float(l.rsplit("|", 2)[1]) for l in profile if l[:4] in ("| 1 ", "| 2 ", "| 5 ")]
  assert len(totals) == 3 and min(totals) > 0, profile


@pytest.mark.heavy  # a benchmark's run (its tokens check guards every real run too)
def test_adaptive_overhead_benchmark_runs_on_tiny_models(tmp_path, refused):
  """The benchmark times plain decoding, the never-drafting policy's speculative loop and its
  generate (plain decoding's loop) at each batch size, checks their tokens equal, and
  reports ratios to plain decoding; a drafter that cannot skip steps is refused. Forced, it
  times a policy always choosing γ against the fixed γ, and switching, a policy choosing as in
  a run against its choices' steps; a forced γ outside the choices, temperatures without
  either, costs that do not match the choices and both modes at once are refused."""
  out = tmp_path / "overhead.md"
  common = ["--target=tiny", "--batch_sizes=1,2", "--new_tokens=4", "--rounds=2", "--prompts=2"]

  def run(*flags, out=out):
    return subprocess.run([sys.executable, "-m", "benchmarks.adaptive_overhead", *common,
                           "--draft=tiny", *flags, f"--out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)

  def rows_of(path, start):
    return [l.split(" | ") for l in path.read_text().splitlines() if l.startswith(start)]

  def check_ratio(cell):  # "median (low–high)"
    median, (low, high) = float(cell.split(" (")[0]), cell.split(" (")[1].split(")")[0].split("–")
    assert 0 < float(low) <= round(median, 2) <= float(high), cell

  proc = run()
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = rows_of(out, "| 1 ") + rows_of(out, "| 2 ")
  assert [r[0] for r in rows] == ["| 1", "| 2"] and all(len(r) == 7 for r in rows), rows
  for r in rows:  # plain's decode ms/token and prefill ms; the others' ratios, with a range
    assert float(r[1]) > 0 and float(r[4]) > 0
    for c in (r[2], r[3], r[5], r[6]):
      check_ratio(c)
  # Forced: a policy always choosing γ against the fixed γ, greedy and sampled (the script
  # stops unless the tokens are equal and every step was at γ).
  forced = tmp_path / "forced.md"
  proc = run("--batch_sizes=1", "--forced_gammas=1,2", "--temperatures=0,1", out=forced)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = rows_of(forced, "| 1 | ")
  assert [(r[1], r[2]) for r in rows] == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")], rows
  for r in rows:
    assert float(r[3]) > 0 and float(r[5]) > 0
    check_ratio(r[4])
    check_ratio(r[6])
  # Switching: the policy as in a run against its choices' steps at their fixed times.
  switching = tmp_path / "switching.md"
  proc = run("--batch_sizes=1", "--switching", "--temperatures=0,1", out=switching)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = rows_of(switching, "| 1 | ")
  assert [r[1] for r in rows] == ["0", "1"], rows
  for r in rows:  # steps counted at each of the five choices; a positive pooled ratio
    counts = [int(x.split(": ")[1]) for x in r[2].split(" / ")]
    assert len(counts) == 5 and sum(counts) > 0 and float(r[3]) > 0, r
    check_ratio(r[4])
    costs = [float(x.split("(")[1].rstrip(") |")) for x in r[5].split(" / ")]
    assert len(costs) == 5 and costs[0] == 1.0 and min(costs) > 0, r
  bad = lambda *flags, draft="tiny": [*common, f"--draft={draft}", *flags,
                                      f"--out={tmp_path / 'b.md'}"]
  refused("benchmarks.adaptive_overhead",
          (bad(draft="jacobi"), "cannot skip steps"),
          (bad("--forced_gammas=5"), "among the choices"),
          (bad("--temperatures=1"), "applies to the forced and switching"),
          (bad("--switching", "--step_costs=1,2"), "5 gammas"),
          (bad("--switching", "--forced_gammas=2"), "give one"))


@pytest.mark.heavy
def test_continuous_batching_benchmark_runs_on_tiny_models(tmp_path):
  out = tmp_path / "cb.md"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.continuous_batching", "--target=tiny",
                         "--draft=eagle", "--slots=2", "--num_prompts=3", "--new_tokens=8",
                         "--budget_spread=0.5", "--rounds=1", f"--out={out}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [l for l in out.read_text().splitlines() if l.startswith("| 2 |")]
  assert len(rows) == 1 and rows[0].count("×") == 6, rows  # 5 methods, continuous / fixed


# ------------------------------------------------------------------ Table 3 corpus, CPU


def test_ngram_corpus_is_deterministic_and_cached_by_content(tmp_path, monkeypatch):
  from experiments import models, ngram_corpus
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  target = models.load_target("tiny")
  built = ngram_corpus.load_or_build(target)
  again = ngram_corpus.load_or_build(target)
  assert not built.cached and again.cached
  assert built.tokens == ngram_corpus.NUM_PROMPTS * ngram_corpus.NEW_TOKENS * 2
  assert all(np.array_equal(a, b) for a, b in zip(built.seqs, again.seqs))
  other = dataclasses.replace(target, params=jax.tree.map(lambda w: w * 1.01, target.params))
  assert not ngram_corpus.load_or_build(other).cached  # other weights, other corpus


def test_cpu_info_reads_model_and_simd_flags(tmp_path):
  from experiments.machine import cpu_info, describe_cpu
  path = tmp_path / "cpuinfo"
  path.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2\n")
  info = cpu_info(str(path))
  assert info == {"model": "Test CPU 9000", "avx512f": False, "avx2": True}
  assert describe_cpu(info) == "Test CPU 9000 (avx2)"
  assert "flags unknown" in describe_cpu(cpu_info(str(tmp_path / "missing")))


# ------------------------------------------------------------------ --stop_at_eos


@pytest.mark.heavy  # an experiment run of its own; EOS stops are pinned in the decoders' tests
def test_stop_at_eos_run_stops_rows_and_stays_consistent(tmp_path, monkeypatch):
  """With --stop_at_eos, rows end at EOS in both methods; counts and equality still hold,
  and at T = 1 (samples of different lengths) speedups compare equal lengths."""
  import dataclasses
  import specjax
  from experiments import experiment, models
  from specjax.sampling import Greedy

  target = models.load_target("tiny")
  # EOS := the 4th token plain greedy writes for the first prompt, so rows do stop early.
  ids = target.encode(prompts.load_items(None, 1)[0].text)
  first = specjax.generate(target.params, target.cfg, [ids], 8, Greedy(), eos_ids=()).generated(0)
  eos = int(first[3])
  cfg = dataclasses.replace(target.cfg, eos_token_ids=(eos,))
  monkeypatch.setattr(experiment, "load_target",
                      lambda source, dtype: dataclasses.replace(target, cfg=cfg))
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=3, gammas=(2,),
                            temperatures=(0.0, 1.0), max_new_tokens=NEW, batch_size=1,
                            experiments=("gamma_sweep",), sweep_trees=(), cost_steps=2,
                            phase_seconds=0.01, stop_at_eos=True, out=str(tmp_path))
  results = experiment.run(config, command="stop_at_eos test")
  sampled = [r for r in results["rows"] if r["temperature"] == 1.0 and r["category"] == "all"]
  run = next(r for r in results["runs"] if r["temperature"] == 1.0 and r["seconds"])
  scale = [max(p) / max(s) for p, s in zip(run["plain_tokens"], run["tokens"])]
  assert scale != [1.0] * len(scale)  # the samples' lengths differ here
  ratios = [sum(p) / sum(pre + (t - pre) * k for t, pre, k in zip(s, pres, scale))
            for p, s, pres in zip(run["plain_seconds"], run["seconds"], run["prefill_seconds"])
            if None not in s]
  assert sampled[0]["speedup"] == pytest.approx(np.median(ratios))
  rows = [r for r in results["rows"] if r["temperature"] == 0.0]
  assert rows and all(r["greedy_match"] == 1.0 for r in rows)
  overall = [r for r in rows if r["category"] == "all"]
  assert overall[0]["generated_tokens"] < overall[0]["prompts"] * NEW  # someone stopped
  for r in rows:
    assert r["emitted"] == r["generated_tokens"] == r["ar_generated_tokens"]
    assert r["accepted"] <= r["emitted"] <= r["accepted"] + r["target_calls"]
  assert "stopping at EOS" in open(os.path.join(str(tmp_path), "tables.md")).read()


@pytest.mark.heavy  # 82 s
def test_a_crowded_process_frees_its_programs_and_compiles_plain_decoding_before_timing(
    tmp_path, monkeypatch):
  """Near the memory-mapping limit (forced here) the bench frees every compiled program
  before a timed group and compiles plain decoding again before timing it, untimed; the
  plain compile time stays the first one; greedy stays exact."""
  import jax
  import specjax
  from experiments import experiment, measure
  released, plain_calls = [], []
  monkeypatch.setattr(measure.compile_cache, "release_if_crowded",
                      lambda: released.append(jax.clear_caches()) or True)
  generate = specjax.generate
  monkeypatch.setattr(measure.specjax, "generate",
                      lambda *a, **k: plain_calls.append(a[3]) or generate(*a, **k))
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=1, gammas=(2,),
                            max_new_tokens=4, experiments=("gamma_sweep",), sweep_trees=(),
                            cost_steps=2, phase_seconds=0.01, repeats=1, extra_rounds=0,
                            out=str(tmp_path))
  results = experiment.run(config, command="crowded test")
  assert len(released) == 2  # one timed group a temperature (T = 0 and 1)
  # per temperature: the compiling call, the call after the release, then the timed ones
  first_one = plain_calls.index(4)
  assert plain_calls[:first_one] == [1, 1] and plain_calls.count(1) == 4
  assert set(results["plain_compile_seconds"]) == {"0", "1"}
  assert all(r["greedy_match"] == 1.0 for r in results["rows"] if r["temperature"] == 0.0)
  assert all(r["speedup"] is not None for r in results["rows"])


@pytest.mark.heavy  # an experiment run of its own; the rule is pinned in test_block_verification
def test_block_verification_runs_the_chains_and_says_so(tmp_path, monkeypatch):
  """--verification=block reaches the chains' decoders (greedy still exact) and the tables."""
  from experiments import experiment, measure
  built = []
  decoder = measure.Bench.decoder
  monkeypatch.setattr(measure.Bench, "decoder",
                      lambda self, *a, **k: built.append(decoder(self, *a, **k)) or built[-1])
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=2, gammas=(2,),
                            temperatures=(0.0, 1.0), max_new_tokens=6, batch_size=1,
                            experiments=("gamma_sweep",), sweep_trees=(), cost_steps=2,
                            phase_seconds=0.01, repeats=1, extra_rounds=0,
                            verification="block", out=str(tmp_path))
  results = experiment.run(config, command="block verification test")
  assert built and all(d.verification == "block" for d in built)
  assert all(r["greedy_match"] == 1.0 for r in results["rows"] if r["temperature"] == 0.0)
  assert ("chains verified block-wise (Sun et al. 2024), trees by traversal verification "
          "(Weng et al. 2025)") in open(tmp_path / "tables.md").read()


@pytest.mark.heavy  # an experiment run of its own; Jacobi decoding is pinned in test_jacobi.py
def test_jacobi_drafts_get_real_alpha_runs(tmp_path):
  """Jacobi reads the target's whole block, so its untimed T = 0 run is real, not replayed."""
  from experiments import experiment
  config = ExperimentConfig(target="tiny", draft="jacobi_random", num_prompts=2, gammas=(2,),
                            temperatures=(0.0, 1.0), max_new_tokens=6, batch_size=1,
                            experiments=("drafts_alpha",), alpha_gamma=3, cost_steps=2,
                            phase_seconds=0.01, alpha_drafts=("jacobi", "prompt_lookup"),
                            out=str(tmp_path))
  rows = [r for r in experiment.run(config, command="jacobi test")["rows"]
          if r["experiment"] == "drafts_alpha" and r["category"] == "all"]
  by = {(r["draft"], r["temperature"]): r for r in rows}
  assert set(by) == {(d, t) for d in ("jacobi_random", "jacobi", "prompt_lookup")
                     for t in (0.0, 1.0)}
  assert not by["jacobi", 0.0]["replayed"] and by["prompt_lookup", 0.0]["replayed"]
  assert all(r["tokens_per_call"] >= 1.0 for r in rows)


# heavy: a full experiment run of its own; the methods' losslessness is pinned in
# test_jacobi.py, test_lookahead.py and test_drafters.py.
@pytest.mark.heavy
def test_draft_free_methods_are_timed_on_their_own_shapes(tmp_path):
  """draft_free times prompt lookup and Jacobi on chains of alpha_gamma and lookahead on its
  own tree, against plain decoding at T = 0 and 1 (always both), greedy-exact; drafts_alpha
  gives lookahead its row too (at T = 0 only, to keep the test short)."""
  from experiments import experiment
  from specjax.drafters import LookaheadDrafter
  config = ExperimentConfig(target="tiny", draft="lookahead", num_prompts=2, gammas=(2,),
                            temperatures=(0.0,), max_new_tokens=6, batch_size=1,
                            experiments=("drafts_alpha", "draft_free"), alpha_gamma=3,
                            cost_steps=2, phase_seconds=0.01, repeats=1, extra_rounds=0,
                            alpha_drafts=("jacobi", "prompt_lookup", "unigram"),
                            draft_free_drafts=("jacobi", "prompt_lookup"), out=str(tmp_path))
  results = experiment.run(config, command="draft-free test")
  rows = [r for r in results["rows"] if r["category"] == "all"]
  free = {(r["draft"], r["temperature"]): r for r in rows if r["experiment"] == "draft_free"}
  assert set(free) == {(d, t) for d in ("lookahead", "jacobi", "prompt_lookup")
                       for t in (0.0, 1.0)}  # unigram has a draft model: alpha only
  tree = LookaheadDrafter(64).default_tree()  # the shape does not depend on V
  la = free["lookahead", 0.0]
  assert la["tree"] == list(tree.parents) and la["gamma"] == tree.max_depth
  assert all(r["speedup"] is not None and r["tokens_per_call"] >= 1.0 for r in free.values())
  assert all(r["greedy_match"] == 1.0 for (d, t), r in free.items() if t == 0.0)
  assert free["jacobi", 1.0]["gamma"] == 3 and free["jacobi", 1.0]["tree"] is None
  alpha = {(r["draft"], r["temperature"]) for r in rows if r["experiment"] == "drafts_alpha"}
  assert ("lookahead", 0.0) in alpha and ("unigram", 0.0) in alpha
  assert "draft_free" in open(tmp_path / "tables.md").read()


@pytest.mark.heavy  # an experiment run of its own; Medusa decoding is pinned in test_medusa.py
def test_medusa_heads_get_table3_rows_on_their_own_tree(tmp_path):
  """--alpha_drafts=medusa measures the heads on their own tree (random heads on the tiny
  target), with their per-depth acceptance in tables.md; a heads directory resolves too."""
  import jax
  from experiments import experiment
  from experiments.models import load_draft, load_target
  from experiments.report import depth_acceptance
  from specjax import drafts
  from specjax.drafters import MedusaDrafter
  from specjax.drafters.medusa import random_medusa_weights
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=2, gammas=(2,),
                            temperatures=(0.0, 1.0), max_new_tokens=6, batch_size=1,
                            experiments=("drafts_alpha",), alpha_gamma=2, cost_steps=2,
                            phase_seconds=0.01, alpha_drafts=("medusa",), out=str(tmp_path))
  target = load_target("tiny")
  medusa = load_draft("medusa", target, lambda: [])
  tree = medusa.drafter.default_tree()
  rows = [r for r in experiment.run(config, command="medusa test")["rows"]
          if r["experiment"] == "drafts_alpha" and r["category"] == "all"
          and r["draft"] == "medusa"]
  assert {r["temperature"] for r in rows} == {0.0, 1.0}
  assert all(r["tree"] == list(tree.parents) and r["shape"] == "own tree" for r in rows)
  assert "Per-depth acceptance on a draft's own tree" in open(tmp_path / "tables.md").read()
  assert depth_acceptance([2, 1, 1]) == [0.5, 0.5]
  weights = random_medusa_weights(target.cfg, 2, 1, jax.random.PRNGKey(0), own_head=False)
  drafts.save_medusa(str(tmp_path / "m"), target.cfg, weights, None, tokenizer_sha256="-")
  d = load_draft(str(tmp_path / "m"), target, lambda: [])
  assert isinstance(d.drafter, MedusaDrafter) and d.name == "m"
  with pytest.raises(ValueError, match="--draft=medusa verifies its own tree"):
    ExperimentConfig(target="tiny", draft="medusa")


def test_trained_exits_resolve_by_name_and_by_directory(tmp_path):
  from experiments.models import load_draft, load_target
  from specjax import drafts
  from specjax.drafters.residual_head import zero_blocks
  target = load_target("tiny")
  d = load_draft("trained_exit", target, lambda: [])
  assert d.drafter.trained and not d.drafter.adapter and d.name == "trained_exit"
  d = load_draft("adapter_exit", target, lambda: [])
  assert d.drafter.adapter and d.name == "adapter_exit"
  drafts.save_exit(str(tmp_path / "x"), target.cfg, zero_blocks(1, 1, target.cfg.dim), None,
                   exit_layer=1, tokenizer_sha256="-")
  d = load_draft(str(tmp_path / "x"), target, lambda: [])
  assert d.drafter.trained and d.drafter.cfg.num_layers == 1 and d.name == "x"


def test_eagle_drafts_resolve_by_name_and_by_directory(tmp_path):
  import jax
  from specjax import drafts
  from specjax.drafters import EagleDrafter
  from specjax.drafters.eagle import random_eagle_weights
  from experiments.models import load_draft, load_target

  target = load_target("tiny")
  assert isinstance(load_draft("eagle", target, lambda: []).drafter, EagleDrafter)
  weights = random_eagle_weights(target.cfg, 1, jax.random.PRNGKey(0))
  drafts.save_eagle(str(tmp_path / "e"), target.cfg, weights, None, tokenizer_sha256="-")
  d = load_draft(str(tmp_path / "e"), target, lambda: [])
  assert isinstance(d.drafter, EagleDrafter) and d.name == "e"


def test_tree_sweep_rows_and_calibration(smoke):
  """Chains and best static trees at T=0 and T=1; trees built from the training-side
  calibration table; greedy tree outputs equal plain greedy decoding."""
  results, out = smoke
  rows = [r for r in results["rows"] if r["experiment"] == "tree_sweep" and r["category"] == "all"]
  assert {r["temperature"] for r in rows} == {0.0, 1.0}
  trees = [r for r in rows if r["shape"] == "best tree"]
  assert trees and all(r["num_nodes"] == len(r["tree"]) and r["speedup"] for r in trees)
  dynamic = [r for r in rows if r["shape"].startswith("dynamic")]
  assert dynamic and all(r["num_nodes"] == r["tree"][3] and r["speedup"] for r in dynamic)
  for t in ("0", "1"):
    cal = results["tree_calibration"][t]
    table = np.asarray(cal["table"])
    assert table.shape == (len(cal["branching"]), max(cal["branching"]))
    assert np.all((table >= 0) & (table <= 1))
    assert 0.01 <= cal["chain_alpha"] <= 0.99  # the chains' rate beside the table
  from specjax.speculative.tree_builders import best_static_tree
  for r in trees:
    table = results["tree_calibration"][f"{r['temperature']:g}"]["table"]
    assert best_static_tree(table, r["num_nodes"]).parents == tuple(r["tree"])
  greedy = [r for r in trees + dynamic if r["temperature"] == 0]
  assert greedy and all(r["greedy_match"] == 1.0 for r in greedy)
  assert "Token trees vs chains" in open(os.path.join(out, "tables.md")).read()
  assert os.path.exists(os.path.join(out, "trees.png"))


def test_the_tree_sweeps_adaptive_row_chooses_among_its_chains_and_trees(smoke):
  """The policy's choices are plain decoding and the sweep's chains and trees, at the step
  costs measured on them, priced by that temperature's calibration table; greedy-exact. A
  temperature whose calibration accepted no rank-0 draft at depth 1 has no adaptive row
  (nothing scales the trees' prices): the random tiny draft's top-ranked drafts match the
  tiny target by chance, and on some CPU kinds (AMD Zen 3: α 0 at T = 0, 0.13 sampled) not
  once in the calibration's tokens, at either temperature; the rows are checked wherever
  the float order of the host gives them."""
  results, out = smoke
  rows = [r for r in results["rows"] if r["experiment"] == "tree_sweep" and r["category"] == "all"]
  runs = {(r["gamma"], r["temperature"], r["tree"] and as_tuple(r["tree"])): r
          for r in results["runs"]}
  known = lambda xs: np.median([x for x in xs if x is not None])
  cost = lambda run: known(run["step_seconds"]) / known(run["plain_step_seconds"])
  adaptive = [r for r in rows if r["shape"] == "adaptive"]
  priced = {t for t in (0.0, 1.0) if results["tree_calibration"][f"{t:g}"]["table"][0][0] > 0}
  assert {r["temperature"] for r in adaptive} == priced
  for r in adaptive:
    t = r["temperature"]
    policy = policy_of(as_tuple(r["tree"]))
    fixed = [f for f in rows if f["temperature"] == t and f["shape"] != "adaptive"]
    assert policy.gammas == (0, 2) and len(policy.trees) == len(fixed) - 1 >= 1
    for f in fixed:
      if f["tree"] is not None:
        i = policy.trees.index(tree_shape(as_tuple(f["tree"]), f["gamma"]))
        assert policy.tree_costs[i] == pytest.approx(
            max(cost(runs[(f["gamma"], t, as_tuple(f["tree"]))]), 1.0), abs=1e-4)
    table = np.asarray(results["tree_calibration"][f"{t:g}"]["table"])
    np.testing.assert_allclose(policy.rank_accept, table, atol=1e-4)
    assert policy.prior_alpha == pytest.approx(  # chains and trees priced from one ease
        results["tree_calibration"][f"{t:g}"]["chain_alpha"], abs=1e-4)
    assert policy.prompt_ease == pytest.approx(  # batches of 2: the calibration's spread
        results["tree_calibration"][f"{t:g}"]["prompt_ease"], abs=1e-4)
    assert r["speedup"] is not None and sum(r["depth_hist"]) == r["target_calls"]
    assert r["tree"][8] == r["min_gain"] == policy.min_gain == 0.05  # the setting's margin
    assert r["tree"][9] == r["evidence"] == policy.evidence == "expected"  # and its count
    assert sum(r["choice_steps"]) == r["target_calls"]  # one count per step, per choice
    assert len(r["choice_steps"]) == len(r["choice_estimate"]) == policy.num_choices
    assert all((e is None) == (n == 0) and (e is None or 0 < e < 1)
               for n, e in zip(r["choice_steps"], r["choice_estimate"]))
    if t == 0:
      assert r["greedy_match"] == 1.0
  tables = open(os.path.join(out, "tables.md")).read()
  if adaptive:
    assert "- adaptive: each step one of plain" in tables and "(α̂ 0." in tables
    assert "one running ease shared by chains and trees" in tables and "α_c = 0." in tables


def test_sweep_trees_parse_from_the_flag_and_size_the_cache():
  assert parse_trees("4:4:4, 3:3:6@1,", "sweep_trees") == ("4:4:4", "3:3:6@1")
  assert parse_trees("", "sweep_trees") == ()
  assert parse_trees("sampled: 3:3:2,4:4:8", "sweep_trees") == ("sampled:3:3:2", "4:4:8")
  # Well-formed entries the tree refuses pass here; the config names them (above).
  assert parse_trees("4:4:3", "sweep_trees") == ("4:4:3",)
  for bad in ("4:4", "4:4:x", "4;4;4", "sampled:", "sampled:2:x", "sample:2:2:2", "4:4:4@",
              "4:4:4@2", "4:4:4@x", "sampled:2@0@1"):
    with pytest.raises(ValueError, match="--sweep_trees must be a comma-separated list of "
                                         "top_k:depth:nodes"):
      parse_trees(bad, "sweep_trees")
  assert sweep_tree("4:4:8") == (DynamicTree(4, 4, 8), (0.0, 1.0))
  assert sweep_tree("sampled:2:1@1") == (SampledDynamicTree((2, 1)), (1.0,))
  assert sweep_tree("4:4:4@0.0") == (DynamicTree(4, 4, 4), (0.0,))
  # A run records a tree as a JSON-friendly setting, and reads it back.
  for tree in (DynamicTree(4, 4, 8), SampledDynamicTree((3, 3, 2))):
    assert setting_tree(tree_setting(tree)) == tree
    assert setting_tree(as_tuple(json.loads(json.dumps(tree_setting(tree))))) == tree
  assert tree_setting(DynamicTree(4, 4, 8)) == ("dynamic", 4, 4, 8)
  assert tree_setting(SampledDynamicTree((2, 1))) == ("sampled", 2, 1)
  # A dynamic tree writes (D - 1) k drafted slots past the prefix, more than its N nodes.
  chains = ExperimentConfig(experiments=("gamma_sweep",), sweep_trees=())
  assert chains.max_draft_nodes == 4  # the largest γ
  assert ExperimentConfig(experiments=("gamma_sweep",)).max_draft_nodes == 12  # 4:4:4@0
  assert ExperimentConfig(experiments=("drafts_alpha",)).max_draft_nodes == 4  # no sweep
  # A sampled dynamic tree writes its N nodes (each fed node at its own slot).
  assert ExperimentConfig(experiments=("gamma_sweep",),
                          sweep_trees=("sampled:3:3:2",)).max_draft_nodes == 8


def test_the_gamma_sweep_measures_its_trees_in_one_group_with_its_chains():
  """One ``spec_many`` call per temperature holds the chains and the dynamic trees (so they
  share interleaved rounds and one plain baseline); a chain-only drafter gets chains."""
  import types
  from experiments import sweeps
  calls = []

  class Bench:
    config = ExperimentConfig(gammas=(1, 2), sweep_trees=("4:4:4", "3:3:6@0", "sampled:2:1@1"))
    batches = []

    def spec_many(self, draft, settings, temperature, timed=True):
      calls.append((list(settings), temperature, timed))
      return []

  trees_too = types.SimpleNamespace(name="d", drafter=types.SimpleNamespace(
      supports=lambda topology: True))
  assert sweeps.gamma_sweep(Bench(), trees_too) == []
  chains = [(1, None), (2, None)]
  eagle2 = (4, ("dynamic", 4, 4, 4))
  assert calls == [(chains + [eagle2, (3, ("dynamic", 3, 3, 6))], 0.0, True),
                   (chains + [eagle2, (2, ("sampled", 2, 1))], 1.0, True)]
  calls.clear()
  chain_only = types.SimpleNamespace(name="d", drafter=types.SimpleNamespace(
      supports=lambda topology: topology.is_chain))
  sweeps.gamma_sweep(Bench(), chain_only)
  assert calls == [(chains, 0.0, True), (chains, 1.0, True)]
  # The best γ is a chain's even where a tree row (γ = its depth) measured faster.
  row = lambda g, tree, speedup: dict(experiment="gamma_sweep", category="all", gamma=g,
                                      tree=tree, speedup=speedup)
  assert sweeps.best_gamma([row(1, None, 1.2), row(2, None, 1.3),
                            row(4, ["dynamic", 4, 4, 4], 1.5)], fallback=3) == 2


def test_the_gamma_sweep_times_its_dynamic_trees_beside_the_chains(smoke):
  """The default --sweep_trees (4:4:4@0, sampled:2:1@1) gets a timed row at its temperature
  in the γ sweep's table, named by its shape: EAGLE-2's tree greedy-exact at T = 0, the
  sampled tree at T = 1."""
  results, out = smoke
  sweep = [r for r in results["rows"] if r["experiment"] == "gamma_sweep" and r["category"] == "all"]
  trees = {r["temperature"]: r for r in sweep if r["tree"] is not None}
  assert sorted(trees) == [0.0, 1.0]
  eagle2, sampled = trees[0.0], trees[1.0]
  assert eagle2["tree"] == ["dynamic", 4, 4, 4] and eagle2["gamma"] == 4
  assert eagle2["num_nodes"] == 4 and eagle2["greedy_match"] == 1.0
  assert sampled["tree"] == ["sampled", 2, 1] and sampled["gamma"] == 2
  assert sampled["num_nodes"] == 3 and sampled["shape"] == "sampled w=2,1"
  for r in trees.values():
    assert r["speedup"] is not None and r["alpha"] is None and r["verify_cost"] is None
  assert results["best_gamma"] == 2  # the only chain
  section = open(os.path.join(out, "tables.md")).read().split("## Speedup vs γ")[1]
  section = section.split("\n## ")[0]
  t0, t1 = section.split("### T = 1")
  assert "| dynamic k=4 N = 4, D = 4 |" in t0 and "sampled" not in t0
  assert "| sampled w=2,1 N = 3, D = 2 |" in t1 and "dynamic k=4" not in t1
  assert "Dynamic tree rows (`--sweep_trees`: EAGLE-2's top-k children" in section


def test_adaptive_rows_use_the_gamma_sweeps_measured_costs(smoke):
  """The policy chooses among plain decoding and the sweep's γs at the step costs the sweep
  measured (made non-decreasing), is timed against plain decoding in the same rounds as the
  sweep's best γ timed again (the sweep's own run kept), and is greedy-exact."""
  from specjax.speculative.calibration import monotone_costs
  results, out = smoke
  rows = [r for r in results["rows"] if r["experiment"] == "adaptive" and r["category"] == "all"]
  assert {r["temperature"] for r in rows} == {0.0, 1.0}
  runs = {(r["draft"], r["gamma"], r["temperature"], r["tree"] and tuple(r["tree"]),
           r["group"]): r for r in results["runs"]}
  for r in rows:
    assert r["shape"] == "adaptive" and r["speedup"] is not None
    t = r["temperature"]
    policy_run = runs[("tiny", 2, t, as_tuple(r["tree"]), "adaptive")]
    beside, own = runs[("tiny", 2, t, None, "adaptive")], runs[("tiny", 2, t, None, "")]
    assert r["paired_gamma"] == 2 and r["paired_speedup"] is not None
    # one plain call per batch and round is the baseline of both: the same rounds
    assert beside["plain_seconds"] == policy_run["plain_seconds"] != own["plain_seconds"]
    policy = policy_of(as_tuple(r["tree"]))
    assert r["tree"][0] == "adaptive" and policy.gammas == (0, 2)  # gammas=(2,)
    sweep = runs[("tiny", 2, r["temperature"], None, "")]
    known = lambda xs: np.median([x for x in xs if x is not None])
    cost = known(sweep["step_seconds"]) / known(sweep["plain_step_seconds"])
    assert policy.step_costs == pytest.approx(monotone_costs((0, 2), (1.0, cost)), abs=1e-4)
    # batches of 2: priced for the slower row, by the 2 calibration prompts' rates
    assert len(policy.prompt_ease) == 2 and 0.01 <= policy.prior_alpha <= 0.99
    assert sum(r["depth_hist"]) == r["target_calls"]
    assert r["min_gain"] == policy.min_gain == 0.05  # the margin it ran with, recorded
    assert len(r["tree"]) == 10 and r["tree"][8] == 0.05  # and carried by its setting,
    assert r["tree"][9] == r["evidence"] == policy.evidence == "expected"  # with its count
    # The chain-only policy's choices have depths of their own: plain at 0, γ = 2 at 2.
    assert r["choice_steps"] == [r["depth_hist"][0], r["depth_hist"][2]]
    if r["temperature"] == 0:
      assert r["greedy_match"] == 1.0
  tables = open(os.path.join(out, "tables.md")).read()
  assert "## Adaptive γ" in tables and "priced for the row they wait on" in tables
  assert "a draft taken only when it promises more than 5% over plain decoding" in tables
  assert "| γ = 2: " in tables and "timed in the same rounds as the sweep's best γ" in tables
  from experiments.report import tables_markdown  # the same tables from results.json
  with open(os.path.join(out, "results.json")) as f:
    assert tables_markdown(json.load(f)) == tables


def test_adaptive_settings_round_trip_with_and_without_the_chains_rate():
  """A setting with trees carries α_c into the policy; records that predate α_c still load
  (at the policy's default)."""
  from experiments.measure import adaptive_setting, setting_chain_alpha
  table = ((0.6, 0.2), (0.5, 0.1))
  trees = (("dynamic", 2, 2, 3),)
  depth, setting = adaptive_setting((0, 1), (1.0, 1.1), trees, (1.3,), table, 0.45678)
  policy = policy_of(as_tuple(json.loads(json.dumps(setting))))
  assert depth == 2 and policy.prior_alpha == 0.4568 and policy.tree_costs == (1.3,)
  _, old = adaptive_setting((0, 1), (1.0, 1.1), trees, (1.3,), table)
  assert len(old) == 6 and policy_of(old).prior_alpha == 0.5
  assert setting_chain_alpha(setting) == 0.4568 and setting_chain_alpha(old) is None
  assert policy_of(old).rank_accept == policy.rank_accept
  assert policy.prompt_ease == ()  # priced for the rows' mean
  # The chains' spread by prompt rides along (batches price for their slowest row), with
  # trees and without; a chains-only policy without it keeps the flat form.
  _, spread = adaptive_setting((0, 1), (1.0, 1.1), trees, (1.3,), table, 0.5, (0.81234, 1.2))
  assert policy_of(as_tuple(json.loads(json.dumps(spread)))).prompt_ease == (0.8123, 1.2)
  depth, chains = adaptive_setting((0, 1, 2), (1.0, 1.1, 1.2), chain_alpha=0.6,
                                   prompt_ease=(0.5, 1.5))
  policy = policy_of(as_tuple(json.loads(json.dumps(chains))))
  assert depth == 2 and policy.trees == () and policy.rank_accept is None
  assert policy.prior_alpha == 0.6 and policy.prompt_ease == (0.5, 1.5)
  assert setting_chain_alpha(chains) == 0.6
  eta = policy.batch_factors[:2, 2]  # γ = 2 at one row and at two
  assert eta[0] == pytest.approx(1.0) and eta[1] < 0.99
  _, flat = adaptive_setting((0, 1), (1.0, 1.1))
  assert flat == ("adaptive", 0, 1, 1.0, 1.1) and setting_chain_alpha(flat) is None


def test_adaptive_settings_carry_their_margin_over_plain_decoding():
  """The margin a draft must promise (``min_gain``) rides in the setting, with or without
  trees, rate and spread, and a policy rebuilt from it (after JSON) drafts as the run's did;
  settings that do not carry it load at the policy's default."""
  from experiments.measure import adaptive_setting, setting_chain_alpha
  from specjax.speculative.adaptive import MIN_GAIN
  assert ExperimentConfig().min_gain == MIN_GAIN  # the flag's default is the policy's
  # γ = 1 promises (1 + α) / 1.4 - 1 ≈ 7.1% over plain decoding at the default prior α = 0.5.
  for margin, drafts in ((0.0, True), (0.05, True), (0.1, False)):
    depth, chains = adaptive_setting((0, 1), (1.0, 1.4), min_gain=margin)
    policy = policy_of(as_tuple(json.loads(json.dumps(chains))))
    assert depth == 1 and policy.min_gain == margin and policy.prior_alpha == 0.5
    assert setting_chain_alpha(chains) is None and policy.prompt_ease == ()
    assert policy.never_drafts(1) is not drafts
  table = ((0.6, 0.2), (0.5, 0.1))
  _, full = adaptive_setting((0, 1), (1.0, 1.1), (("dynamic", 2, 2, 3),), (1.3,), table, 0.45,
                             (0.8, 1.2), 0.2)
  policy = policy_of(as_tuple(json.loads(json.dumps(full))))
  assert (policy.min_gain, policy.prior_alpha, policy.prompt_ease) == (0.2, 0.45, (0.8, 1.2))
  _, without = adaptive_setting((0, 1), (1.0, 1.1), (("dynamic", 2, 2, 3),), (1.3,), table, 0.45)
  assert policy_of(without).min_gain == MIN_GAIN and len(without) == 7


def test_adaptive_settings_carry_what_their_policy_counts():
  """What a sampled chain step counts (``evidence``) rides in the setting's tenth slot (the
  margin before it, the default where none was given), so records counted otherwise are
  other settings; settings without it load at the policy's default and say so (None)."""
  from experiments.measure import adaptive_setting, setting_evidence
  from experiments.report import evidence_words
  from specjax.speculative.adaptive import MIN_GAIN, AdaptiveGamma
  assert ExperimentConfig().evidence == AdaptiveGamma(gammas=(1,), step_costs=(1.0,)).evidence
  table = ((0.6, 0.2), (0.5, 0.1))
  for evidence in ("expected", "accepted"):
    _, chains = adaptive_setting((0, 1), (1.0, 1.4), evidence=evidence)
    _, full = adaptive_setting((0, 1), (1.0, 1.1), (("dynamic", 2, 2, 3),), (1.3,), table, 0.45,
                               (0.8, 1.2), 0.2, evidence)
    for setting, margin in ((chains, MIN_GAIN), (full, 0.2)):
      loaded = as_tuple(json.loads(json.dumps(setting)))
      assert len(loaded) == 10 and setting_evidence(loaded) == evidence
      assert (policy_of(loaded).evidence, policy_of(loaded).min_gain) == (evidence, margin)
  assert adaptive_setting((0, 1), (1.0, 1.4), evidence="accepted") != adaptive_setting(
      (0, 1), (1.0, 1.4), evidence="expected")
  _, old = adaptive_setting((0, 1), (1.0, 1.4), min_gain=0.05)
  assert setting_evidence(old) is None and policy_of(old).evidence == "expected"
  assert setting_evidence(None) is None and setting_evidence((2, 0, -1)) is None
  with pytest.raises(ValueError, match="evidence must be one of"):
    adaptive_setting((0, 1), (1.0, 1.4), evidence="outcomes")
  assert "β" in evidence_words(["expected"]) and "outcomes" in evidence_words(["accepted"])
  assert "not recorded" in evidence_words([None, "expected"])


def test_batched_adaptive_rows_price_for_the_slowest_row(monkeypatch):
  """At batch > 1 the chains-only adaptive row measures the chains' rate and spread on the
  calibration prompts (as deep as its deepest γ) and its policy carries both; at batch 1 it
  measures nothing more (its setting carries neither, only the margin)."""
  import types
  from experiments import sweeps
  settings, asked = [], []
  monkeypatch.setattr(sweeps, "_paired_rows", lambda bench, draft, t, setting, gamma:
                      settings.append(setting) or [])
  monkeypatch.setattr(sweeps, "_best_gamma_of", lambda bench, runs: 3)
  monkeypatch.setattr(sweeps, "step_cost", lambda run: run)

  class Bench:
    target = types.SimpleNamespace(encode=lambda text: [1, 2, 3])

    def __init__(self, batch_size):
      self.config = ExperimentConfig(gammas=(1, 3), batch_size=batch_size,
                                     calibration_prompts=3)

    def spec_many(self, draft, jobs, temperature, timed=True):
      return [1.1 + 0.1 * g for g, _ in jobs]

    def chain_rates(self, draft, temperature, prompts, gamma):
      asked.append((temperature, len(prompts), gamma))
      return 0.6, (0.5, 1.0, 1.5)

  draft = types.SimpleNamespace(name="d", drafter=types.SimpleNamespace(
      tolerates_skipped_steps=lambda: True))
  sweeps.adaptive(Bench(4), draft)
  assert asked == [(0.0, 3, 3), (1.0, 3, 3)]
  for _, setting in settings:
    policy = policy_of(setting)
    assert policy.gammas == (0, 1, 3) and policy.prior_alpha == 0.6
    assert policy.prompt_ease == (0.5, 1.0, 1.5)
    assert policy.min_gain == 0.05 and setting[9] == policy.evidence == "expected"
  asked.clear(), settings.clear()
  sweeps.adaptive(Bench(1), draft)
  assert asked == [] and len(settings) == 2
  for _, setting in settings:  # no rate, no spread: the policy's default prior, the margin
    policy = policy_of(setting)
    assert setting[6] is None and (policy.prior_alpha, policy.prompt_ease) == (0.5, ())
    assert policy.min_gain == 0.05


def test_default_run_is_the_papers_tables_and_all_adds_the_tree_sweep():
  from experiments.config import DEFAULT_EXPERIMENTS, EXPERIMENTS, parse_experiments
  assert parse_experiments("default") == DEFAULT_EXPERIMENTS == ExperimentConfig().experiments
  assert "tree_sweep" not in DEFAULT_EXPERIMENTS and "adaptive" in DEFAULT_EXPERIMENTS
  assert parse_experiments("all") == EXPERIMENTS and "tree_sweep" in EXPERIMENTS


def test_calibrated_batches_benchmark_rereads_a_committed_run(tmp_path, benchmark_module):
  """benchmarks.calibrated_batches prices every timed chain setting of a committed batch-4
  run both ways: the slowest-row prediction is the experiments' own column (rows), below the
  pooled-α one where the rows' α spread; a directory without a log is refused."""
  bench = benchmark_module("calibrated_batches")
  directory = "experiments/results/intel_xeon_batch4_adaptive"
  config, runs = bench._runs(directory)
  assert config["batch_size"] == 4 and sorted(r.gamma for r in runs) == [1, 1, 2, 2]
  with open(os.path.join(directory, "results.json")) as f:
    calibrated = {(r["gamma"], r["temperature"]): r["calibrated_speedup"]
                  for r in json.load(f)["rows"]
                  if r["experiment"] == "gamma_sweep" and r["category"] == "all"}
  for run in runs:
    row = bench._row(run)
    measured, pooled, slowest, whole = (float(cell.strip("*").split("×")[0])
                                        for cell in (row[3], *row[-3:]))
    assert slowest == pytest.approx(calibrated[(run.gamma, run.temperature)], abs=1e-3)
    assert slowest < pooled
    # the prefill (13% of plain decoding's time here, a little slower speculatively) pulls
    # the whole call's prediction toward the measured speedup
    assert whole < slowest and abs(whole - measured) < abs(slowest - measured)
  with pytest.raises(SystemExit, match="no progress.jsonl"):
    bench._runs(str(tmp_path))


def test_policy_decisions_benchmark_reads_the_sweeps_policies_and_names_their_choices(
    tmp_path, benchmark_module):
  """benchmarks.policy_decisions takes each temperature's adaptive tree-sweep row (or the
  default run's adaptive γ row) from a results.json, holds each of its draft choices fixed
  beside it (plain decoding needs no run) and adds its twin that counts outcomes (at T > 0)
  and its chains-only twin; a missing file or temperature is refused before loading."""
  bench = benchmark_module("policy_decisions")
  settings, sweep_policies = bench.settings, bench.sweep_policies
  path = "experiments/results/avx2_zen3/trees_adaptive_batch1/results.json"
  policy = sweep_policies(path, [1.0])[1.0]
  table = settings(policy, 1.0)
  assert list(table)[:2] == ["γ = 1", "γ = 2"] and "plain" not in table
  assert list(table)[-3:] == ["adaptive", "adaptive, outcomes counted",
                              "adaptive, chains only"]
  counted = table["adaptive, outcomes counted"][0]
  assert counted == dataclasses.replace(policy, evidence="accepted")
  assert policy.evidence == "expected" and "adaptive, outcomes counted" not in settings(policy, 0.0)
  fixed = [k for k, (pol, _, _) in table.items() if pol is None]
  assert len(fixed) == policy.num_choices - 1  # every choice but plain decoding
  assert [table[k][2] for k in fixed] == list(policy.costs[1:])
  chains = table["adaptive, chains only"][0]
  assert chains.trees == () and chains.gammas == policy.gammas
  assert chains.step_costs == policy.step_costs and chains.decay == policy.decay
  # That sweep predates α_c: it is measured (here: stubbed) and given to every policy.
  asked = []
  rated = sweep_policies(path, [0.0, 1.0], lambda res, t: asked.append(t) or 0.3125)
  assert asked == [0.0, 1.0] and {p.prior_alpha for p in rated.values()} == {0.3125}
  assert chains.prior_alpha == policy.prior_alpha == 0.5  # no chain_rate: the default
  with pytest.raises(ValueError, match=r"no adaptive row at T = \[0.5\]"):
    sweep_policies(path, [0.5])
  # The default run's adaptive γ row: chains and plain decoding, its prior as it ran.
  default = sweep_policies("experiments/results/avx2_zen3/results.json", [1.0],
                           lambda res, t: asked.append(t) or 0.3125)[1.0]
  assert default.gammas == (0, 1, 2, 3, 4) and not default.trees
  assert default.prior_alpha == 0.5 and asked == [0.0, 1.0]  # not re-measured
  with pytest.raises(FileNotFoundError, match="no such file"):
    sweep_policies(str(tmp_path / "missing.json"), [1.0])
  # Its chains are verified as the run verified them; a run from before the choice, token-wise.
  assert bench.run_verification("experiments/results/avx512_zen4/results.json") == "block"
  (tmp_path / "old.json").write_text(json.dumps({"config": {}}))
  assert bench.run_verification(str(tmp_path / "old.json")) == "tokenwise"


def test_xla_flags_benchmark_refuses_bad_sets_and_counts_the_bits_that_differ(benchmark_module):
  """benchmarks.xla_flags: a reference and at least one set, every flag an --xla_... one, no
  set twice (before any process starts); its comparison counts arrays not bit for bit equal
  (ints and floats), takes the largest float difference, treats -inf padding in the same
  places as equal, and refuses workloads that wrote different arrays."""
  bench = benchmark_module("xla_flags")
  assert bench.parse_flag_sets(" ; --xla_a=1 --xla_b=2") == ["", "--xla_a=1 --xla_b=2"]
  assert bench.parse_flag_sets(bench.FLAG_SETS.default)[0] == ""  # the default's reference
  for bad, message in (("", "needs a reference"), (";-O2", "not an --xla_"),
                       (";--xla_a=1;--xla_a=1", "repeats a set")):
    with pytest.raises(SystemExit, match=message):
      bench.parse_flag_sets(bad)
  lp = np.array([[-0.5, -np.inf], [-1.0, -np.inf]], np.float32)
  ref = dict(ids=np.array([3, 4]), logp=lp)
  assert bench.compare(ref, dict(ids=np.array([3, 4]), logp=lp.copy())) == dict(
      arrays=2, differ=0, max_diff=0.0)
  moved = lp.copy()
  moved[1, 0] = -0.75
  d = bench.compare(ref, dict(ids=np.array([3, 5]), logp=moved))
  assert d == dict(arrays=2, differ=2, max_diff=0.25)
  with pytest.raises(ValueError, match="different arrays"):
    bench.compare(ref, dict(ids=np.array([3, 4])))


def test_alpha_pairs_bootstraps_the_prompts_pairwise(benchmark_module):
  """benchmarks.alpha_pairs: the difference of pooled α, with no spread between a draft and
  itself, a spread where prompts disagree, and refusals of unequal prompt counts."""
  bench = benchmark_module("alpha_pairs")
  a = (np.array([3.0, 1.0, 2.0]), np.array([4.0, 4.0, 4.0]), (0,))
  assert bench.paired_difference(a, a, draws=200, seed=0) == (0.0, 0.0)
  b = (np.array([2.0, 2.0, 2.0]), np.array([4.0, 4.0, 4.0]), (0,))
  diff, sd = bench.paired_difference(a, b, draws=2000, seed=0)
  assert diff == pytest.approx(0.0) and 0.0 < sd < 0.25  # same pooled α, prompts disagree
  shifted = (a[0] + 1.0, a[1], a[2])
  diff, sd = bench.paired_difference(shifted, a, draws=2000, seed=0)
  assert diff == pytest.approx(0.25) and sd == pytest.approx(0.0, abs=1e-12)
  with pytest.raises(SystemExit, match="3 and 2 prompts"):
    bench.paired_difference(a, (b[0][:2], b[1][:2], b[2]), draws=10, seed=0)


def test_alpha_pairs_pools_seeds_at_t_above_zero_only(benchmark_module, tmp_path):
  """Runs under other seeds add (seed, prompt) answers at T > 0; at T = 0 the seed draws
  nothing, so equal greedy counters count once and unequal ones are refused, as are pairs
  drawn under different seeds."""
  from experiments.measure import SpecRun
  bench = benchmark_module("alpha_pairs")

  def run_dir(name, seed, runs):
    d = tmp_path / name
    d.mkdir()
    lines = [dict(header=dict(config=dict(seed=seed)))] + [
        dict(run=SpecRun(draft=draft, gamma=4, temperature=t, counters=[dict(
            beta_sum=np.array(sums, float), beta_count=np.array([4.0] * len(sums)))],
                         generated=[], steps=[]).to_record()) for draft, t, sums in runs]
    (d / "progress.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    return str(d)

  greedy = [("a", 0.0, [3.0, 1.0]), ("b", 0.0, [2.0, 2.0])]
  s0 = run_dir("s0", 0, greedy + [("a", 1.0, [1.0, 2.0]), ("b", 1.0, [2.0, 2.0])])
  s1 = run_dir("s1", 1, greedy + [("a", 1.0, [3.0, 4.0]), ("b", 1.0, [1.0, 1.0])])
  data = bench.per_prompt([s0, s1])
  assert data[("a", 0.0)][2] == (0,) and list(data[("a", 0.0)][0]) == [3.0, 1.0]
  assert data[("a", 1.0)][2] == (0, 1) and list(data[("a", 1.0)][0]) == [1.0, 2.0, 3.0, 4.0]
  diff, _ = bench.paired_difference(data[("a", 1.0)], data[("b", 1.0)], draws=10, seed=0)
  assert diff == pytest.approx((10.0 - 6.0) / 16.0)
  bad = run_dir("bad", 2, [("a", 0.0, [1.0, 1.0])])
  with pytest.raises(SystemExit, match=r"a at T = 0.0 differs between --runs \(any seed\)"):
    bench.per_prompt([s0, bad])
  data = bench.per_prompt([s0, s1, run_dir("other", 2, [("b", 1.0, [1.0, 1.0])])])
  with pytest.raises(SystemExit, match=r"drawn under seeds \(0, 1\) and \(0, 1, 2\)"):
    bench.paired_difference(data[("a", 1.0)], data[("b", 1.0)], draws=10, seed=0)


def test_train_steps_prices_each_length_at_its_median_per_invocation(benchmark_module, tmp_path):
  """benchmarks.train_steps: steps split at each invocation line (the host that took them),
  a compiling step does not move its length's median, and the ratio is the longest length's
  median over the mean step priced at the medians."""
  bench = benchmark_module("train_steps")
  rows = [dict(step=1, seconds=30.0, length=128, rows=4, trained=100),  # (compiles)
          dict(step=2, seconds=5.0, length=128, rows=4, trained=100),
          dict(step=3, seconds=5.0, length=128, rows=4, trained=100),
          dict(step=4, seconds=20.0, length=416, rows=4, trained=400)]
  header = dict(invocation="2026-12-07 05:00:00", cpu="x", cpu_family="25", cpu_model="17",
                cores=2, git=dict(commit="abc", dirty=False), command="c")
  path = tmp_path / "steps.jsonl"
  path.write_text("\n".join(json.dumps(m) for m in [rows[0], header, *rows[1:]]) + "\n"
                  + '{"step": 5, "seco')  # (a line cut short by a kill)
  parts = bench.invocations(str(path))
  assert [h for h, _ in parts] == [{}, header] and [len(s) for _, s in parts] == [1, 3]
  s = bench.summary(rows)
  assert s["median"] == {128: 5.0, 416: 20.0} and s["count"] == {128: 3, 416: 1}
  assert s["typical"] == pytest.approx((3 * 5.0 + 20.0) / 4)
  assert s["ratio"] == pytest.approx(20.0 / 8.75) and s["longest"] == 416
  assert s["positions_per_s"] == pytest.approx(700 / 60.0) and s["mean"] == 15.0


def test_adaptive_rows_of_old_records_compare_with_the_sweeps_rounds():
  """A results.json from before the pairing (no paired_speedup) still renders: its adaptive
  ratio is against the sweep's best γ, labelled so; a paired one's against the γ beside it."""
  from experiments.report import tables_markdown
  root = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "avx512_zen5")
  with open(os.path.join(root, "results_499b9e9.json")) as f:
    old = tables_markdown(json.load(f))
  assert "| γ = 3 (1.60×), sweep only | 100% |" in old
  # A paired record pinned by name (results.json is replaced by each new run).
  with open(os.path.join(root, "results_cbc9584.json")) as f:
    new = tables_markdown(json.load(f))
  assert "| γ = 3: 1.47×, **1.63×** | 99% |" in new and "sweep only" not in new
