"""--prompts in Spec-Bench's question.jsonl shape: first turns, categories kept, clear errors."""

import csv
import json
import os

import pytest

from experiments import prompts

# Spec-Bench's shape (data/spec_bench/question.jsonl): MT-bench questions have two turns,
# the other subtasks one.
SPEC_BENCH = [
    {"question_id": 81, "category": "writing",
     "turns": ["Write a blog post about Hawaii.", "Rewrite it; start every sentence with A."]},
    {"question_id": 111, "category": "math",
     "turns": ["What is the area of the triangle (0, 0), (-1, 1), (3, 3)?",
               "What is the area of the circle circumscribing it?"]},
    {"question_id": 161, "category": "translation", "turns": ["Translate to English: Guten Tag."]},
    {"question_id": 241, "category": "qa", "turns": ["Who wrote Hamlet?"]},
]


def _write(tmp_path, lines):
  path = tmp_path / "question.jsonl"
  path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n"
                          for line in lines))
  return str(path)


def test_each_question_is_its_first_turn_with_its_category(tmp_path):
  path = _write(tmp_path, SPEC_BENCH)
  items = prompts.load_prompt_file(path)
  assert [(p.text, p.category) for p in items] == [(q["turns"][0], q["category"])
                                                   for q in SPEC_BENCH]
  assert [p.source for p in items] == [f"{path}:1 (turn 1 of 2)", f"{path}:2 (turn 1 of 2)",
                                       f"{path}:3", f"{path}:4"]


def test_spec_bench_and_our_lines_mix(tmp_path):
  items = prompts.load_prompt_file(_write(
      tmp_path, [{"prompt": "a", "category": "code"}, "\n", {"turns": ["b", "c"]}]))
  assert [(p.text, p.category) for p in items] == [("a", "code"), ("b", "uncategorised")]


@pytest.mark.parametrize("line, message", [
    ({"question_id": 1, "category": "qa"}, 'line 2: missing required key "prompt" '
                                           '\\(or Spec-Bench\'s "turns"'),
    ({"prompt": "a", "turns": ["b"]}, 'line 2: has both "prompt" and "turns"'),
    ({"turns": []}, 'line 2: "turns" is empty'),
    ({"turns": "one turn"}, 'line 2: "turns" must be a list of strings, got str'),
    ({"turns": ["ok", 3]}, 'line 2: turn 2 of "turns" must be a string, got int'),
    ({"turns": ["  "]}, 'line 2: turn 1 of "turns" is empty'),
    ({"turns": ["ok", ""]}, 'line 2: turn 2 of "turns" is empty'),
    ({"turns": ["ok"], "category": ""}, 'line 2: "category" must be a non-empty string'),
])
def test_bad_spec_bench_lines_name_the_file_and_line(tmp_path, line, message):
  path = _write(tmp_path, [SPEC_BENCH[0], line])
  with pytest.raises(prompts.PromptFileError, match=message) as e:
    prompts.load_prompt_file(path)
  assert str(e.value).startswith(f"{path}, line 2: ")


@pytest.mark.heavy  # an experiment run of its own; the smoke run's tables cover "category"
def test_spec_bench_categories_reach_the_results_tables(tmp_path):
  """The categories reach results.json, results.csv and tables.md like "category" does."""
  from experiments import experiment
  from experiments.config import ExperimentConfig
  config = ExperimentConfig(target="tiny", draft="tiny", prompts=_write(tmp_path, SPEC_BENCH),
                            experiments=("gamma_sweep",), sweep_trees=(), gammas=(2,), temperatures=(0.0,),
                            max_new_tokens=4, batch_size=1, cost_steps=1, phase_seconds=0.01,
                            repeats=1, extra_rounds=0, out=str(tmp_path / "out"))
  results = experiment.run(config, command="spec-bench prompts test")
  wanted = [q["category"] for q in SPEC_BENCH]
  assert results["categories"] == wanted
  assert {r["category"] for r in results["rows"]} == {*wanted, "all"}
  assert [p["text"] for p in results["prompts"]] == [q["turns"][0] for q in SPEC_BENCH]
  with open(os.path.join(config.out, "results.csv")) as f:
    assert set(wanted) <= {r["category"] for r in csv.DictReader(f)}
  tables = open(os.path.join(config.out, "tables.md")).read()
  assert all(f"| {c} |" in tables for c in wanted)
