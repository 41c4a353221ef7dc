"""Request state machine, KV block accounting and the step loop (no torch)."""
