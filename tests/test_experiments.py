"""experiments.run on tiny random models: every output file, consistent numbers, prompt checks."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import prompts
from experiments.config import ExperimentConfig
from specjax import theory

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
  assert {"cpu", "cores", "jax"} <= set(saved["machine"])
  assert len(saved["rows"]) == len(results["rows"])
  assert {r["experiment"] for r in saved["rows"]} == {"gamma_sweep", "temperature_sweep",
                                                      "drafts_alpha"}


def test_token_counts_agree_with_accepted_counts(smoke):
  rows = smoke[0]["rows"]
  for r in rows:
    g, hist = r["gamma"], np.asarray(r["accept_len_hist"])
    assert r["drafted"] == g * r["target_calls"]
    assert hist.sum() == r["target_calls"]
    assert (hist * np.arange(g + 1)).sum() == r["accepted"]
    # emitted = accepted + one target token per call, minus what the budget cut off
    assert r["accepted"] <= r["emitted"] <= r["accepted"] + r["target_calls"]
    assert r["emitted"] == r["generated_tokens"] == r["prompts"] * NEW  # EOS ignored
    assert r["tokens_per_call"] == pytest.approx(r["emitted"] / r["target_calls"])
    assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])
    assert 0.0 <= r["alpha"] <= 1.0


def test_speedups_are_ratios_of_measured_times(smoke):
  results = smoke[0]
  timed = [r for r in results["rows"] if r["speedup"] is not None]
  assert timed
  for r in timed:
    assert r["speedup"] == pytest.approx(r["ar_seconds"] / r["spec_seconds"])
    assert r["ar_generated_tokens"] == r["generated_tokens"]
  for run in results["runs"]:
    if run["seconds"] is None:
      continue
    key = (run["draft"], run["gamma"], run["temperature"])
    rows = [r for r in timed if (r["draft"], r["gamma"], r["temperature"]) == key
            and r["experiment"] == "gamma_sweep"]
    overall = [r for r in rows if r["category"] == "all"]
    assert overall and all(r["spec_seconds"] == pytest.approx(sum(run["seconds"]))
                           for r in overall)
    assert sum(r["spec_seconds"] for r in rows if r["category"] != "all") == pytest.approx(
        sum(run["seconds"]))


def test_predictions_follow_the_theory_from_measured_alpha_and_c(smoke):
  predicted = [r for r in smoke[0]["rows"] if r["predicted_speedup"] is not None]
  assert predicted
  for r in predicted:
    assert r["predicted_speedup"] == pytest.approx(
        theory.walltime_improvement(r["alpha"], r["gamma"], r["c"]))
    t1 = r["step_seconds"]
    # verify cost = the measured speculative step minus the draft's share, in target steps
    # (left empty when timer noise on a tiny model makes it <= 0)
    verify = r["spec_step_seconds"] / t1 - r["gamma"] * r["c"]
    if verify <= 0:
      assert r["verify_cost"] is None and r["calibrated_speedup"] is None
      continue
    assert r["verify_cost"] == pytest.approx(verify)
    assert r["calibrated_speedup"] == pytest.approx(
        r["expected_tokens_per_call"] / (r["gamma"] * r["c"] + r["verify_cost"]))


def test_greedy_speculative_output_equals_plain_greedy(smoke):
  greedy = [r for r in smoke[0]["rows"] if r["greedy_match"] is not None]
  assert greedy and all(r["greedy_match"] == 1.0 for r in greedy)


def test_csv_and_tables(smoke):
  results, out = smoke
  with open(os.path.join(out, "results.csv")) as f:
    assert len(list(csv.DictReader(f))) == len(results["rows"])
  text = open(os.path.join(out, "tables.md")).read()
  for heading in ("Speedup vs γ", "Speedup vs temperature", "α of each draft",
                  "The paper's numbers", "| CNNDM | T5-small | 0 | 5 | 0.65 | 3.1× |"):
    assert heading in text


def test_padding_rows_are_left_out_of_statistics(smoke):
  # 3 prompts of 3 categories in batches of 2: every batch has one padding row.
  results = smoke[0]
  assert results["num_prompts"] == 3
  overall = [r for r in results["rows"] if r["category"] == "all"]
  assert all(r["prompts"] == 3 for r in overall)


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


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="gammas"):
    ExperimentConfig(gammas=(0,))
  with pytest.raises(ValueError, match="unknown experiments"):
    ExperimentConfig(experiments=("nope",))
  with pytest.raises(ValueError, match="repeats"):
    ExperimentConfig(repeats=0)


def test_repeated_timing_keeps_the_fastest_call():
  from types import SimpleNamespace
  from experiments.measure import Bench
  bench = Bench.__new__(Bench)  # only the config matters to the timing rule
  bench.config = ExperimentConfig(repeats=3)
  times, calls = iter([0.3, 0.1, 0.2]), []
  call = lambda: calls.append(1) or SimpleNamespace(seconds=next(times))
  assert bench._fastest(call).seconds == 0.1 and len(calls) == 3
  assert bench._fastest(lambda: SimpleNamespace(seconds=5.0), repeats=1).seconds == 5.0


# ------------------------------------------------------------------ --stop_at_eos


def test_stop_at_eos_run_stops_rows_and_stays_consistent(tmp_path, monkeypatch):
  """With --stop_at_eos, rows end at EOS in both methods; counts and equality still hold."""
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
                      lambda source: dataclasses.replace(target, cfg=cfg))
  config = ExperimentConfig(target="tiny", draft="tiny", num_prompts=3, gammas=(2,),
                            temperatures=(0.0,), max_new_tokens=NEW, batch_size=1,
                            experiments=("gamma_sweep",), cost_steps=2, stop_at_eos=True,
                            out=str(tmp_path))
  results = experiment.run(config, command="stop_at_eos test")
  rows = [r for r in results["rows"] if r["temperature"] == 0.0]
  assert rows and all(r["greedy_match"] == 1.0 for r in rows)
  overall = [r for r in rows if r["category"] == "all"]
  assert overall[0]["generated_tokens"] < overall[0]["prompts"] * NEW  # someone stopped
  for r in rows:
    assert r["emitted"] == r["generated_tokens"] == r["ar_generated_tokens"]
    assert r["accepted"] <= r["emitted"] <= r["accepted"] + r["target_calls"]
  assert "stopping at EOS" in open(os.path.join(str(tmp_path), "tables.md")).read()


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
