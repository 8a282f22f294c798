"""The gpu tier: CUDA only (make test-gpu). tests/README.md."""
