"""Training: LoRA + stream-embedding fine-tuning, export, task data, evaluation. Never imports vLLM."""
