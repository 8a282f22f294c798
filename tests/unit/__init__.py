"""The unit tier: no Ray, vLLM or Slurm; seconds (make test-fast). tests/README.md."""
