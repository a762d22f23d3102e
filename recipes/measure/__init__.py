"""The measurement tools: memory, start-up, profiles and throughput, each a script that opens with its usage lines."""
