"""Developer tools: the crash campaign, the protocol fuzzer (run on demand, not imported by ectier)."""
