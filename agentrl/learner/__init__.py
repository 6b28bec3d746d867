"""The learner: FSDP2 training loop, losses, advantage estimators, packing, checkpoints."""
