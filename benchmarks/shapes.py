"""Target shapes with random weights for the model-level benchmarks (``verify_curve``,
``attention_dispatch``): real architectures' sizes without their checkpoints."""

from specjax.config import ModelConfig

SHAPES = {
    # Llama-3-8B: 32 layers, width 4096, 32/8 heads of 128, FFN 14336, vocabulary 128256.
    "llama3_8b": ModelConfig(vocab_size=128256, dim=4096, num_layers=32, num_heads=32,
                             num_kv_heads=8, ffn_dim=14336, rope_theta=500000.0,
                             name="llama3-8b-shaped"),
    # SmolLM2-135M, the embedded target: 30 layers, width 576, 9/3 heads of 64, FFN 1536.
    "smollm2_135m": ModelConfig(vocab_size=49152, dim=576, num_layers=30, num_heads=9,
                                num_kv_heads=3, ffn_dim=1536, rope_theta=100000.0,
                                tie_embeddings=True, name="smollm2-135m-shaped"),
    "tiny": ModelConfig(vocab_size=512, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                        ffn_dim=128, name="tiny"),
}
# The EAGLE-3-shaped drafter's vocabulary: EAGLE-3's published 32000 for Llama-3-8B, the
# shipped SmolLM2 drafter's 8192.
DRAFT_VOCAB = {"llama3_8b": 32000, "smollm2_135m": 8192, "tiny": 128}
