"""One replica's engine in one process: LLMEngine, the LLM API, config, outputs, executors."""
