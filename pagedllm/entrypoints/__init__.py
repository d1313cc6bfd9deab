"""What users call: the offline LLM, the chat REPL and beam search over the engine core."""
