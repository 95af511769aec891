"""What only serves the demo and the tests: tiny checkpoints, sample data, run-log checks."""
