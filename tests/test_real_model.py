"""The embedded SmolLM2-135M-Instruct against Hugging Face transformers' own Llama.

The reference loads the same GGUF file with transformers, which does its own
dequantisation and q/k un-permutation, so it is independent of specjax's loader.
"""

import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax.loaders import chat_prompt, load_model, load_model_tokenizer, smollm2_gguf_path
from specjax.loaders.embedded import cache_dir

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "List three prime numbers.", "Write a haiku about the sea.", "Why is the sky blue?",
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "How do I boil an egg?", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
    "Name a famous painter.", "Give me a tip for learning to code.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def ours():
  return load_model()


@pytest.fixture(scope="module")
def tok():
  return load_model_tokenizer()


def _hf_from_gguf():
  import torch
  from transformers import AutoModelForCausalLM

  path = smollm2_gguf_path()
  return AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32)


def _hf_reference():
  """transformers' own load of the GGUF, kept as float32 safetensors next to specjax's cache.

  Parsing the GGUF in transformers costs ~25 s of CPU; its ``save_pretrained``
  output reloads in a fraction of a second. No specjax code touches these
  weights, so the reference stays independent.
  """
  import torch
  from transformers import AutoModelForCausalLM

  gguf_path = smollm2_gguf_path()
  stamp = f"{os.path.getsize(gguf_path)}-{int(os.path.getmtime(gguf_path))}"
  ref_dir = os.path.join(cache_dir(), f"hf-reference-smollm2-135m-instruct-{stamp}")
  if os.path.exists(os.path.join(ref_dir, "model.safetensors")):
    try:
      return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    except Exception:  # pylint: disable=broad-except
      shutil.rmtree(ref_dir, ignore_errors=True)  # corrupt: rebuilt below
  model = _hf_from_gguf()
  del model.config.quantization_config  # weights are plain float32 now
  model.hf_quantizer = None
  os.makedirs(cache_dir(), exist_ok=True)
  tmp = tempfile.mkdtemp(dir=cache_dir())
  model.save_pretrained(tmp)
  try:
    os.replace(tmp, ref_dir)
  except OSError:  # another process won the race
    shutil.rmtree(tmp, ignore_errors=True)
  return model


@pytest.fixture(scope="module")
def hf():
  import torch

  # One thread: on a shared 2-core machine, two torch threads contend with
  # everything else and token-by-token generation runs several times slower.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield _hf_reference().eval()
  torch.set_num_threads(threads)


def _hf_greedy(hf, prompt, n):
  import torch

  ids = torch.tensor([prompt])
  with torch.no_grad():
    # An explicit attention mask: the prompt contains <|im_end|>, which is also
    # the pad token, and HF would otherwise mask it out.
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=hf.config.pad_token_id)
  return out[0, len(prompt):].tolist()


def test_logits_match_transformers_on_five_prompts(ours, tok, hf):
  import torch

  cfg, params = ours
  prompts = [chat_prompt(tok, q) for q in QUESTIONS[:3]] + [
      tok.encode("The quick brown fox jumps over the lazy dog."),
      tok.encode("def fibonacci(n):\n    return n if n < 2 else"),
  ]
  width = 64  # one right-padded batch, one compile; causality hides the padding
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  logits = np.asarray(specjax.forward(
      params, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(width), tokens.shape),
      kvc.init_cache(cfg, len(prompts), width)).logits)
  for i, p in enumerate(prompts):
    with torch.no_grad():
      ref = hf(torch.tensor([p])).logits[0].numpy()
    np.testing.assert_allclose(logits[i, :len(p)], ref, atol=1e-3, rtol=0, err_msg=f"prompt {i}")


def _check_greedy(ours, tok, hf, questions):
  cfg, params = ours
  prompts = [chat_prompt(tok, q) for q in questions]
  out = specjax.generate(params, cfg, prompts, NEW_TOKENS, eos_ids=())
  for i, p in enumerate(prompts):
    assert out.generated(i) == _hf_greedy(hf, p, NEW_TOKENS), questions[i]


def test_greedy_generation_matches_transformers_on_three_chat_prompts(ours, tok, hf):
  _check_greedy(ours, tok, hf, QUESTIONS[:3])


@pytest.mark.heavy
def test_greedy_generation_matches_transformers_on_ten_chat_prompts(ours, tok, hf):
  _check_greedy(ours, tok, hf, QUESTIONS)


def test_tokenizer_round_trips_text(tok):
  for text in ["Hello, world!", "  leading spaces and\ttabs\n", "Ünïcödé — 日本語 🙂", "x = [1, 2]"]:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_prompt_ends_in_the_assistant_turn(ours, tok):
  cfg, _ = ours
  assert "<|im_start|>assistant" in tok.chat_template
  text = tok.decode(chat_prompt(tok, "Hi"))
  assert "<|im_start|>user\nHi<|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n")
  assert cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_config_without_weights_equals_the_loaded_config(ours, monkeypatch, tmp_path):
  from specjax.loaders import embedded
  assert embedded.smollm2_config() == ours[0]  # from the float32 cache's JSON
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))  # no cache: from the GGUF metadata
  assert embedded.smollm2_config() == ours[0]


def test_cached_tokenizer_equals_the_one_built_from_the_gguf(monkeypatch, tmp_path):
  from specjax.drafts import tokenizer_fingerprint
  from specjax.loaders import load_tokenizer

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  path = smollm2_gguf_path()
  built = load_tokenizer(path, use_cache=False)
  assert not os.listdir(tmp_path)
  load_tokenizer(path)  # builds and writes the cache entry
  (entry,) = os.listdir(tmp_path)
  assert entry.startswith("tokenizer-SmolLM2-135M-Instruct.Q4_1-")
  cached = load_tokenizer(path)  # reads it
  assert tokenizer_fingerprint(cached) == tokenizer_fingerprint(built)
  assert cached.chat_template == built.chat_template
  assert cached.all_special_ids == built.all_special_ids
  for text in ["Hello, world!", "  leading spaces and\ttabs\n", "Ünïcödé — 日本語 🙂",
               "def f(x):\n    return x ** 2"]:
    assert cached.encode(text) == built.encode(text)
    assert chat_prompt(cached, text) == chat_prompt(built, text)
  # A corrupt entry is rebuilt, not an error, and rewritten.
  with open(os.path.join(tmp_path, entry, "tokenizer.json"), "w") as f:
    f.write("{not json")
  assert tokenizer_fingerprint(load_tokenizer(path)) == tokenizer_fingerprint(built)
  with open(os.path.join(tmp_path, entry, "tokenizer.json")) as f:
    assert f.read(1) == "{" and "not json" not in f.read(100)
