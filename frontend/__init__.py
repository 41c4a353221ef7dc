"""API servers, tokenization and detokenization, the client library, the CLI, offline LLM."""
