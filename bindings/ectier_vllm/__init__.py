"""vLLM bindings for ectier (the ECConnector lands here; see docs/vllm.md when it exists)."""
