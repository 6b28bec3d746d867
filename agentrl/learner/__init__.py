"""The learner: the backend seam (FSDP2 first), its config, training loop, losses, advantage
estimators, GAE and the critic, packing, checkpoints."""
