"""The integration tier: the real Ray, vLLM, training and Slurm runs that CI's make test runs, with their second
runs beside them marked extended. tests/README.md."""
