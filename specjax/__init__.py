"""specjax: lossless speculative decoding in JAX."""

from specjax.config import ModelConfig, RopeScaling
from specjax.drafts import load_default_draft
from specjax.generate import GenerateOutput, generate
from specjax.kv_cache import KVCache, init_cache
from specjax.loaders import (CheckpointError, chat_prompt, load_model, load_model_tokenizer,
                             load_tokenizer)
from specjax.model import ForwardOutput, forward, init_params
from specjax.sampling import Greedy, Sampling, make_sampler

__all__ = [
    "CheckpointError", "ForwardOutput", "GenerateOutput", "Greedy", "KVCache", "ModelConfig",
    "RopeScaling", "Sampling", "chat_prompt", "forward", "generate", "init_cache", "init_params",
    "load_default_draft", "load_model", "load_model_tokenizer", "load_tokenizer", "make_sampler",
]
