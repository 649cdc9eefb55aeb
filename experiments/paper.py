"""The papers' own numbers (from shared/PAPER_NUMBERS.md), printed beside ours in tables.md."""

# Leviathan et al. 2023, Table 2: (task, draft, T, γ, α, speedup).
TABLE2 = (
    ("EnDe", "T5-small", 0, 7, 0.75, 3.4), ("EnDe", "T5-base", 0, 7, 0.80, 2.8),
    ("EnDe", "T5-large", 0, 7, 0.82, 1.7), ("EnDe", "T5-small", 1, 7, 0.62, 2.6),
    ("EnDe", "T5-base", 1, 5, 0.68, 2.4), ("EnDe", "T5-large", 1, 3, 0.71, 1.4),
    ("CNNDM", "T5-small", 0, 5, 0.65, 3.1), ("CNNDM", "T5-base", 0, 5, 0.73, 3.0),
    ("CNNDM", "T5-large", 0, 3, 0.74, 2.2), ("CNNDM", "T5-small", 1, 5, 0.53, 2.3),
    ("CNNDM", "T5-base", 1, 3, 0.55, 2.2), ("CNNDM", "T5-large", 1, 3, 0.56, 1.7),
)

# Table 3: (target, draft, α T=0, α T=1).
TABLE3 = (
    ("GPT-like 97M", "unigram", "0.03", "0.03"), ("GPT-like 97M", "bigram", "0.05", "0.05"),
    ("GPT-like 97M", "GPT-like 6M", "0.88", "0.89"),
    ("T5-XXL EnDe", "unigram / bigram", "0.08 / 0.20", "0.07 / 0.19"),
    ("T5-XXL CNNDM", "unigram / bigram", "0.13 / 0.23", "0.08 / 0.16"),
    ("LaMDA 137B", "100M / 2B / 8B", "0.61 / 0.71 / 0.75", "0.57 / 0.71 / 0.74"),
)

# Table 4: expected (Thm 3.8 with measured c) vs empirical speedup, T=0.
TABLE4 = (
    ("EnDe", "T5-small", 0.02, 3.2, 3.4), ("EnDe", "T5-base", 0.04, 3.3, 2.8),
    ("EnDe", "T5-large", 0.11, 2.5, 1.7), ("CNNDM", "T5-small", 0.02, 2.4, 3.1),
    ("CNNDM", "T5-base", 0.04, 2.6, 3.0), ("CNNDM", "T5-large", 0.11, 2.0, 2.2),
)

SETUP = ("Leviathan, Kalman, Matias, ICML 2023 (arXiv 2211.17192): target T5-XXL (11B), "
         "drafts T5-small/base/large, batch 1, one TPU-v4, baseline T5X.")
