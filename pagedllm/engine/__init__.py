"""The engine: the offline LLMEngine, the engine core (the step loop), the input and output
processors around it, and the core process with the channel and messages that connect it
to the API process."""
