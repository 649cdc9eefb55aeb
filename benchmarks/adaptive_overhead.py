"""What an adaptive decoder costs beyond the decoding it chooses: plain decoding, or a draft.

Usage:
  python -m benchmarks.adaptive_overhead [--batch_sizes 1,4] [--new_tokens 128] [--rounds 5]
      [--draft eagle] [--target smollm2] [--out benchmarks/results/adaptive_overhead.md]
  python -m benchmarks.adaptive_overhead --forced_gammas 2,4 [--temperatures 0,1]
      [--choices 0,1,2,3,4] [...]
  python -m benchmarks.adaptive_overhead --switching [--temperatures 0,1] [--choices 0,1,2,3,4]
      [--step_costs 1,1.07,1.14,1.18,1.25] [...]

The adaptive policy's price of plain decoding is 1 (a plain step costs what plain decoding's
step does) and the calibrated whole-call figure takes the speculative prefill as measured.
This measures both claims on held-out prompts, greedy, EOS ignored, in ``--rounds``
interleaved rounds per batch size (medians reported), three ways:

  plain       ``specjax.generate``;
  loop        the speculative decoder's own loop (``prepare`` then ``run``) under a policy
              that never drafts (γ ∈ {0, 1}, γ = 1 priced at 50 plain steps): every step a
              plain step, with the drafter prefilled and its state carried;
  generate    ``SpeculativeDecoder.generate`` with that policy, which sees that it never
              drafts and runs plain decoding's loop on the packed prompts
              (``plain_only``).

For each: the prefill (validation and packing included, both models for ``loop``) and the
decode loop per generated token, with their ratios to plain decoding's. The three must
produce the same tokens (the run stops otherwise).

With ``--forced_gammas`` it measures the policy's loop where it drafts instead: for each γ
listed and each of ``--temperatures``, a fixed-γ ``SpeculativeDecoder`` against the same
decoder under a policy over ``--choices`` (the default run's set) priced so that it always
chooses that γ (its step cost 0.01 plain steps, every other draft's 50): the choice, the
per-choice inner loops and the estimates' update, with the step itself unchanged. Both draw
from the same seed, so they must produce the same tokens at every temperature (the run
stops otherwise), and the forced policy must have taken every step at its γ. What remains
between them is the policy's own cost per step, which the default run's adaptive row
measures mixed with its choices (``benchmarks.policy_decisions`` models the choices alone).

A forced policy never leaves its inner loop. With ``--switching`` the policy chooses as it
does in a run (over ``--choices`` at ``--step_costs``, which need only make it switch), and
each round decodes every one of the ``--prompts`` prompts (in batches of B) with it and with
each of its choices held fixed (γ = 0: the never-drafting policy's ``generate``, plain
decoding's loop), the decoders in
an order that rotates by round, all from the round's seed. A call's **predicted** decode
time is Σ_k n_k t_k: the batch's steps at each choice k (the counts of its longest-running
row, active at every step) times that choice's time per step, its fixed decoder's on the
same prompts in the same round. Measured over predicted is then what switching between
the choices' loops costs beyond their steps.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import numpy as np
import tqdm
from absl import app, flags

import specjax
from benchmarks.common import int_list, provenance, temperature_list, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.sampling import Greedy, make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma

BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "batch sizes")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt", lower_bound=2)
ROUNDS = flags.DEFINE_integer("rounds", 5, "interleaved timed rounds", lower_bound=1)
PROMPTS = flags.DEFINE_integer("prompts", 8, "distinct held-out prompts (cycled to fill a "
                               "batch)", lower_bound=1)
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
TARGET = flags.DEFINE_string("target", "smollm2", "target (experiments.models.load_target spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/adaptive_overhead.md", "markdown output")
FORCED = flags.DEFINE_list("forced_gammas", [], "draft lengths at which to time a policy "
                           "forced to always choose them against the fixed γ (empty: time "
                           "the never-drafting policy against plain decoding)")
TEMPS = flags.DEFINE_list("temperatures", ["0"], "temperatures of the forced comparison "
                          "(the never-drafting one is greedy)")
CHOICES = flags.DEFINE_list("choices", ["0", "1", "2", "3", "4"], "the forced or switching "
                            "policy's choices (each forced γ among them)")
SWITCHING = flags.DEFINE_bool("switching", False, "time the policy choosing as in a run "
                              "against its choices held fixed (the module docstring)")
STEP_COSTS = flags.DEFINE_list("step_costs", ["1", "1.07", "1.14", "1.18", "1.25"],
                               "the switching policy's step cost of each choice, in plain "
                               "steps (default: the Zen 4 default run's at T = 1, git bd21e70)")

METHODS = ("plain", "loop", "generate")
FORCED_METHODS = ("fixed", "forced")


def never_drafting() -> AdaptiveGamma:
  """A policy that decodes plainly at every step: γ = 1 priced at 50 plain steps."""
  return AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 50.0))


def _decoder(target, draft, temperature: float, **kwargs) -> SpeculativeDecoder:
  """A decoder of ``draft`` for ``target`` at ``temperature``, EOS ignored; ``kwargs`` its
  ``gamma`` or ``policy``."""
  return SpeculativeDecoder(target.cfg, draft.drafter, sampler=make_sampler(temperature),
                            eos_ids=(), **kwargs)


def _calls(target, draft, prompts: list, new: int, cache: int) -> dict:
  """{method: () -> (seconds, prefill seconds, tokens)}."""
  dec = _decoder(target, draft, 0.0, policy=never_drafting())
  if not dec.plain_only(len(prompts)):
    raise SystemExit("the never-drafting policy would draft: nothing to measure")
  tp, dp = target.params, draft.params

  def plain():
    out = specjax.generate(tp, target.cfg, prompts, new, Greedy(), cache_size=cache,
                           eos_ids=())
    return out.seconds, out.prefill_seconds, np.asarray(out.tokens)

  def loop():  # generate's own timing of its speculative loop, without the plain_only turn
    start = time.perf_counter()
    state, _ = jax.block_until_ready(dec.prepare(tp, dp, prompts, new, cache_size=cache))
    prefill = time.perf_counter() - start
    state = jax.block_until_ready(dec.run(tp, dp, state))
    return time.perf_counter() - start, prefill, np.asarray(state.tokens)

  def generate():
    out = dec.generate(tp, dp, prompts, new, cache_size=cache)
    return out.seconds, out.prefill_seconds, np.asarray(out.tokens)

  return dict(plain=plain, loop=loop, generate=generate)


def forced_policy(choices: list[int], gamma: int) -> AdaptiveGamma:
  """A policy over ``choices`` that chooses ``gamma`` at every step, whatever its estimate:
  that draft priced at 0.01 plain steps (a score of at least 100 against plain decoding's 1
  and at most (max γ + 1) / 50 for the other drafts, priced at 50)."""
  if gamma < 1 or gamma not in choices:
    raise ValueError(f"forced γ {gamma} must be >= 1 and among the choices {choices}")
  return AdaptiveGamma(gammas=tuple(choices), step_costs=tuple(
      1.0 if g == 0 else 0.01 if g == gamma else 50.0 for g in choices))


def _forced_calls(target, draft, prompts: list, new: int, cache: int, gamma: int,
                  temperature: float, choices: list[int]) -> dict:
  """{method: () -> (seconds, prefill seconds, tokens, choice steps)}: fixed γ and the policy
  forced to it, one seed for both."""
  decoders = dict(fixed=_decoder(target, draft, temperature, gamma=gamma),
                  forced=_decoder(target, draft, temperature,
                                  policy=forced_policy(choices, gamma)))

  def call(dec):
    def run():
      out = dec.generate(target.params, draft.params, prompts, new, seed=0, cache_size=cache)
      return (out.seconds, out.prefill_seconds, np.asarray(out.tokens),
              out.per_row.get("choice_steps"))
    return run

  return {m: call(d) for m, d in decoders.items()}


def _timed(calls: dict, rows: list, new: int, label: str) -> tuple[dict, dict]:
  """Compiles every call, checks that its tokens equal the first method's, then times them in
  ``--rounds`` interleaved rounds (each round starting from the next method): ({method:
  [(seconds, prefill seconds)]}, {method: the compiling call's outputs})."""
  methods = list(calls)
  outs = {m: f() for m, f in calls.items()}  # compile
  made = lambda tokens: [tokens[i, len(p):len(p) + new].tolist() for i, p in enumerate(rows)]
  for m in methods[1:]:
    if made(outs[m][2]) != made(outs[methods[0]][2]):
      raise SystemExit(f"{label}: {m}'s tokens differ from {methods[0]}'s")
  times = {m: [] for m in methods}
  for r in range(ROUNDS.value):
    k = r % len(methods)
    for m in methods[k:] + methods[:k]:
      times[m].append(calls[m]()[:2])
  return times, outs


def _cell(times: dict, new: int, base: str) -> dict:
  """Each method's median prefill and decode per token, with each round's ratios to
  ``base``'s call in the same round."""
  ref = np.asarray(times[base])
  cell = {}
  for m, runs in times.items():
    t = np.asarray(runs)
    decode = (t[:, 0] - t[:, 1]) / new
    cell[m] = dict(prefill=float(np.median(t[:, 1])), decode_per_token=float(np.median(decode)),
                   decode_ratios=(decode / ((ref[:, 0] - ref[:, 1]) / new)).tolist(),
                   prefill_ratios=(t[:, 1] / ref[:, 1]).tolist())
  return cell


def _switching_decoders(target, draft, choices: list[int], costs: list[float],
                        temperature: float) -> dict:
  """{"adaptive": the policy, k: choice k held fixed} (k = 0: the never-drafting policy, whose
  ``generate`` runs plain decoding's loop)."""
  make = functools.partial(_decoder, target, draft, temperature)
  decoders = {"adaptive": make(policy=AdaptiveGamma(gammas=tuple(choices),
                                                    step_costs=tuple(costs)))}
  for k in choices:
    decoders[k] = make(policy=never_drafting()) if k == 0 else make(gamma=k)
  return decoders


def _measure_switching(target, draft, prompts: list, batch: int, temperature: float,
                       choices: list[int], costs: list[float]) -> dict:
  new = NEW.value
  calls = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
  decoders = _switching_decoders(target, draft, choices, costs, temperature)
  keys = list(decoders)
  ratios, measured, predicted, taken = [], 0.0, 0.0, np.zeros(len(choices), np.int64)
  per_step_all = {k: [] for k in choices}
  for r in tqdm.trange(ROUNDS.value + 1, desc=f"B={batch}, T={temperature:g}"):
    for rows in calls:
      cache = max(len(p) for p in rows) + new + 8
      runs = {}
      for k in keys[r % len(keys):] + keys[:r % len(keys)]:
        out = decoders[k].generate(target.params, draft.params, rows, new, seed=r,
                                   cache_size=cache)
        runs[k] = (out.seconds - out.prefill_seconds, out.steps, out.per_row.get("choice_steps"))
      if r == 0:
        continue  # compiling
      seconds, _, steps = runs["adaptive"]
      steps = np.asarray(steps)
      steps = steps[np.argmax(steps.sum(axis=1))]  # the row active at every step
      per_step = [runs[k][0] / runs[k][1] for k in choices]
      for k, t in zip(choices, per_step):
        per_step_all[k].append(t)
      guess = float(np.dot(steps, per_step))
      ratios.append(seconds / guess)
      measured, predicted, taken = measured + seconds, predicted + guess, taken + steps
  cell = dict(batch=batch, temperature=temperature, steps=taken.tolist(), ratios=ratios,
              pooled=measured / predicted, measured=measured, predicted=predicted,
              step_ms=[float(np.median(per_step_all[k])) * 1e3 for k in choices])
  print(f"[{time.strftime('%H:%M:%S')}] B={batch}, T={temperature:g}: steps by choice "
        f"{taken.tolist()}, measured / predicted {cell['pooled']:.3f} pooled, "
        f"{np.median(ratios):.3f} median call", flush=True)
  return cell


def _print(label: str, cell: dict, methods) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {label}: " + ", ".join(
      f"{m} prefill {cell[m]['prefill'] * 1e3:.0f} ms, decode "
      f"{cell[m]['decode_per_token'] * 1e3:.1f} ms/token" for m in methods), flush=True)


def _batch_rows(prompts: list, batch: int) -> tuple[list, int]:
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  return rows, max(len(p) for p in rows) + NEW.value + 8


def _measure(target, draft, prompts: list, batch: int) -> dict:
  rows, cache = _batch_rows(prompts, batch)
  times, _ = _timed(_calls(target, draft, rows, NEW.value, cache), rows, NEW.value, f"B={batch}")
  cell = {"batch": batch, **_cell(times, NEW.value, "plain")}
  _print(f"B={batch}", cell, METHODS)
  return cell


def _measure_forced(target, draft, prompts: list, batch: int, gamma: int, temperature: float,
                    choices: list[int]) -> dict:
  rows, cache = _batch_rows(prompts, batch)
  label = f"B={batch}, T={temperature:g}, γ={gamma}"
  calls = _forced_calls(target, draft, rows, NEW.value, cache, gamma, temperature, choices)
  times, outs = _timed(calls, rows, NEW.value, label)
  steps = np.asarray(outs["forced"][3]).sum(axis=0)
  if steps.sum() == 0 or steps.sum() != steps[choices.index(gamma)]:
    raise SystemExit(f"{label}: the forced policy's steps by choice {steps.tolist()} are not "
                     f"all at γ = {gamma}")
  cell = {"batch": batch, "temperature": temperature, "gamma": gamma,
          **_cell(times, NEW.value, "fixed")}
  _print(label, cell, FORCED_METHODS)
  return cell


def _report(cells: list[dict], command: str) -> list[str]:
  lines = ["# The adaptive decoder decoding plainly: its loop and prefill against plain "
           "decoding's", "", f"Command: `{command}`  ", provenance() + ".", "",
           f"{DRAFT.value} draft, greedy, {NEW.value} new tokens a row (EOS ignored), "
           f"{_rows_text()}, {ROUNDS.value} "
           "interleaved rounds (medians). loop = the speculative decoder's own loop under a "
           "policy that never drafts (each step a plain step; both models prefilled); "
           "generate = `SpeculativeDecoder.generate` with it (plain decoding's loop on the "
           "packed prompts). Decode = the call after its prefill, per generated token. The "
           "loop's and generate's columns are ratios to plain decoding's call in the same "
           "round: the median round, in brackets the range over rounds. Tokens equal plain "
           "decoding's in every call.", "",
           "| B | plain decode ms/token | loop decode / plain | generate decode / plain | "
           "plain prefill ms | loop prefill / plain | generate prefill / plain |",
           "|---|---|---|---|---|---|---|"]
  for c in cells:
    p = c["plain"]
    lines.append(f"| {c['batch']} | {p['decode_per_token'] * 1e3:.2f} | "
                 f"{_ratio(c['loop']['decode_ratios'])} | "
                 f"{_ratio(c['generate']['decode_ratios'])} | {p['prefill'] * 1e3:.0f} | "
                 f"{_ratio(c['loop']['prefill_ratios'])} | "
                 f"{_ratio(c['generate']['prefill_ratios'])} |")
  return lines


def _rows_text() -> str:
  return (f"a batch of B takes the first B of {PROMPTS.value} held-out prompts (cycled past "
          f"{PROMPTS.value}; at B = 1 the first alone)")


def _ratio(xs) -> str:
  """The median round's ratio, in brackets the range over rounds."""
  return f"{np.median(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})"


def _report_forced(cells: list[dict], command: str, choices: list[int]) -> list[str]:
  lines = ["# The adaptive decoder forced to one draft length: its loop against the fixed γ",
           "", f"Command: `{command}`  ", provenance() + ".", "",
           f"{DRAFT.value} draft, {NEW.value} new tokens a row (EOS ignored), "
           f"{_rows_text()}, {ROUNDS.value} interleaved rounds "
           "(medians). fixed = `SpeculativeDecoder(gamma=γ)`; forced = the same decoder under "
           f"a policy over γ ∈ {{{', '.join(map(str, choices))}}} priced to choose γ at every "
           "step (it did: every step counted at γ), so its choice, per-choice loops and "
           "estimates run as in the default run's adaptive row while the steps are the fixed "
           "γ's. Same seed: the tokens equal the fixed decoder's in every call, sampled ones "
           "included. Decode = the call after its prefill, per generated token; forced / fixed "
           "= the ratio to the fixed decoder's call in the same round: the median round, in "
           "brackets the range over rounds.", "",
           "| B | T | γ | fixed decode ms/token | forced decode / fixed | fixed prefill ms | "
           "forced prefill / fixed |", "|---|---|---|---|---|---|---|"]
  for c in cells:
    f = c["fixed"]
    lines.append(f"| {c['batch']} | {c['temperature']:g} | {c['gamma']} | "
                 f"{f['decode_per_token'] * 1e3:.2f} | {_ratio(c['forced']['decode_ratios'])} | "
                 f"{f['prefill'] * 1e3:.0f} | {_ratio(c['forced']['prefill_ratios'])} |")
  return lines


def _report_switching(cells: list[dict], command: str, choices: list[int],
                      costs: list[float]) -> list[str]:
  lines = ["# The adaptive decoder switching between draft lengths: its decode against its "
           "choices' steps", "", f"Command: `{command}`  ", provenance() + ".", "",
           f"{DRAFT.value} draft, {NEW.value} new tokens a row (EOS ignored), the first "
           f"{PROMPTS.value} held-out prompts in batches of B, {ROUNDS.value} rounds. The "
           f"policy chooses among γ ∈ {{{', '.join(map(str, choices))}}} at step costs "
           f"{', '.join(f'{c:g}' for c in costs)} as in a run; each round decodes every batch "
           "with it and with each choice held fixed (γ = 0: plain decoding's loop), "
           "in an order rotating by round, all from the round's seed. Predicted = Σ_k n_k t_k, "
           "the policy's steps at each choice times the fixed decoder's time per step on the "
           "same batch in the same round; measured / predicted: pooled over the calls, and "
           "the median call with the range over calls in brackets. Fixed steps: each choice's "
           "time per step held fixed, the median call, and over the first choice's (plain "
           "decoding's where 0 is a choice): the step costs these rounds measured, beside the "
           "prices the policy was given.", "",
           "| B | T | steps at γ (all rounds) | measured / predicted, pooled | median call "
           "(range) | fixed steps, ms (cost) |", "|---|---|---|---|---|---|"]
  for c in cells:
    taken = " / ".join(f"{g}: {n}" for g, n in zip(choices, c["steps"]))
    fixed = " / ".join(f"{g}: {t:.1f} ({t / c['step_ms'][0]:.2f})"
                       for g, t in zip(choices, c["step_ms"]))
    lines.append(f"| {c['batch']} | {c['temperature']:g} | {taken} | {c['pooled']:.3f} | "
                 f"{_ratio(c['ratios'])} | {fixed} |")
  return lines


def main(_):
  batches = int_list(BATCHES)
  forced, temperatures = int_list(FORCED) if FORCED.value else [], temperature_list(TEMPS)
  choices = int_list(CHOICES, least=0)
  if forced and SWITCHING.value:
    raise SystemExit("--forced_gammas and --switching are two measurements: give one")
  if not (forced or SWITCHING.value) and temperatures != [0.0]:
    raise SystemExit("--temperatures applies to the forced and switching comparisons "
                     "(--forced_gammas, --switching); the never-drafting policy is timed greedy")
  costs = []
  if SWITCHING.value:
    try:
      costs = [float(c) for c in STEP_COSTS.value]
      AdaptiveGamma(gammas=tuple(choices), step_costs=tuple(costs))
    except ValueError as e:
      raise SystemExit(f"--choices / --step_costs: {e}") from None
  for g in forced:
    try:
      forced_policy(choices, g)
    except ValueError as e:
      raise SystemExit(f"--forced_gammas: {e}") from None
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target(TARGET.value)
  draft = load_draft(DRAFT.value, target, lambda: [])
  policy_mode = forced or SWITCHING.value
  plain_steps = 0 in choices or not policy_mode  # the never-drafting mode times only those
  if plain_steps and not draft.drafter.tolerates_skipped_steps():
    raise SystemExit(f"draft {DRAFT.value!r} cannot skip steps: no plain steps to measure"
                     + (" (leave 0 out of --choices)" if policy_mode else ""))
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  cells = []
  command = " ".join(["python -m benchmarks.adaptive_overhead", *sys.argv[1:]])
  if forced:
    settings = [(b, t, g) for b in batches for t in temperatures for g in forced]
    for i, (b, t, g) in enumerate(settings):
      cells.append(_measure_forced(target, draft, prompts, b, g, t, choices))
      write_markdown(OUT.value, _report_forced(cells, command, choices),
                     quiet=i != len(settings) - 1)
    return
  if SWITCHING.value:
    settings = [(b, t) for b in batches for t in temperatures]
    for i, (b, t) in enumerate(settings):
      cells.append(_measure_switching(target, draft, prompts, b, t, choices, costs))
      write_markdown(OUT.value, _report_switching(cells, command, choices, costs),
                     quiet=i != len(settings) - 1)
    return
  for batch in batches:
    cells.append(_measure(target, draft, prompts, batch))
    write_markdown(OUT.value, _report(cells, command), quiet=batch != batches[-1])


if __name__ == "__main__":
  app.run(main)
