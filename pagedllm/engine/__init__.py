"""The engine: the offline LLMEngine, the engine core (the step loop: core.py, over the one map of
requests in core_requests.py, the groups of request_group.py and token_choice.py; what it steps is
built by core_loader.py), the input and output processors around it, and the core process with the
channel and messages that connect it to the API process."""
