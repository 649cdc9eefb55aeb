"""Draft models on disk: the directory formats, the shipped SmolLM2 drafts, HF export.

  ``format``  the token, EAGLE, Medusa and trained-exit draft directories (``draft.json`` +
              ``weights.safetensors`` or its shards), their writers and loaders, and the one
              check both loaders share (``read_checked_metadata``): a draft is
              never paired with a target whose vocabulary or tokenizer
              fingerprint differs from the one it was made for.
  ``shards``  a directory's tensors on disk: one ``weights.safetensors``, or past 15 MB
              shards listed by an index, so no file goes over 16 MB (``weight_files``).
  ``zoo``     the drafts shipped in ``specjax/assets/`` (``default_drafter``,
              ``default_eagle_drafter``, ``default_medusa_drafter``, ``default_exit_drafter``)
              and ``drafter_from_path``, the one
              entry point for a draft given as a path, whatever its kind.
  ``export``  a token draft as a standard Hugging Face Llama directory.
  ``eagle_published``  SafeAILab's EAGLE-1/2 and EAGLE-3 checkpoints, loaded unchanged
              into an ``EagleDrafter`` with the published wiring.
  ``medusa_published``  FasterDecoding's Medusa-1 heads, loaded unchanged into a
              ``MedusaDrafter``.

Every public name is handed on here: ``specjax.drafts.load_draft`` and
``from specjax.drafts import default_drafter`` are the way in.
"""

from specjax.drafts.eagle_published import load_published_eagle, published_eagle_weights
from specjax.drafts.medusa_published import load_published_medusa, published_medusa_weights
from specjax.drafts.export import expand_to_full_vocab, export_hf
from specjax.drafts.format import (EAGLE_FORMAT, EXIT_FORMAT, FORMAT, MEDUSA_FORMAT,
                                   cut_eagle_head, load_draft, load_eagle, load_exit,
                                   load_medusa, load_trained_weights,
                                   read_checked_metadata, read_draft_metadata, save_draft,
                                   save_eagle, save_exit, save_medusa, tokenizer_fingerprint)
from specjax.drafts.shards import weight_files
from specjax.drafts.zoo import (DEFAULT_ADAPTER_EXIT_DIR, DEFAULT_DRAFT_DIR, DEFAULT_EAGLE_DIR,
                                DEFAULT_EXIT_DIR, DEFAULT_MEDUSA_DIR, default_drafter,
                                default_eagle_drafter, default_exit_drafter,
                                default_medusa_drafter, drafter_from_path, load_default_draft,
                                reads_target_rows)

__all__ = [
    "DEFAULT_ADAPTER_EXIT_DIR", "DEFAULT_DRAFT_DIR", "DEFAULT_EAGLE_DIR", "DEFAULT_EXIT_DIR",
    "DEFAULT_MEDUSA_DIR", "EAGLE_FORMAT", "EXIT_FORMAT", "FORMAT", "MEDUSA_FORMAT",
    "cut_eagle_head",
    "default_drafter", "default_eagle_drafter", "default_exit_drafter", "default_medusa_drafter",
    "drafter_from_path", "expand_to_full_vocab", "export_hf", "load_default_draft",
    "load_draft", "load_eagle", "load_exit", "load_medusa", "load_trained_weights",
    "load_published_eagle",
    "load_published_medusa", "published_eagle_weights", "published_medusa_weights",
    "read_checked_metadata", "read_draft_metadata", "reads_target_rows", "save_draft",
    "save_eagle", "save_exit", "save_medusa", "tokenizer_fingerprint", "weight_files",
]
