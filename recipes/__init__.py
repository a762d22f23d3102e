"""shardgpt recipes: the training script and its helpers, the HF Trainer path, benchmarks and tools."""
