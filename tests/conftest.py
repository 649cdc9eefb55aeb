"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
  """A full `experiments.run` on tiny random models: (results dict, output directory).

  Shared by tests/test_experiments.py (which checks its numbers) and
  tests/test_notebooks.py (results.ipynb reads it).
  """
  from experiments import experiment
  from experiments.config import ExperimentConfig
  out = str(tmp_path_factory.mktemp("smoke"))
  cfg = ExperimentConfig(target="tiny", draft="tiny", num_prompts=3, gammas=(2,),
                         temperatures=(0.0, 1.0), max_new_tokens=8, batch_size=2,
                         alpha_gamma=2, alpha_drafts=("prompt_lookup",), cost_steps=2, out=out)
  return experiment.run(cfg, command="smoke test"), out
