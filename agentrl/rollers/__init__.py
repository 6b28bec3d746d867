"""Rollers: the roller main loop, the agent loop (episode runner) and the staleness gate."""
