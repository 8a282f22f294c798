"""The extended tier: marked extended, run by make test-all only. tests/README.md."""
