"""Inference: clients for SGLang / vLLM / embedded servers, the router, and `agentrl serve`."""
