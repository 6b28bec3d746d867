"""Checkpoint engines that push learner weights to inference servers, and the HybridEngine."""
