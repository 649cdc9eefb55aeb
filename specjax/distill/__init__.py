"""Training drafts by self-distillation from the target (data, losses, training loop, α)."""
