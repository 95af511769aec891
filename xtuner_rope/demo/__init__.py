"""What only serves the demo and the tests: the tiny checkpoints, the sample dialogues, the
``model_resource`` helper that builds the tiny checkpoint, and run-log checks.

Nothing in the plugin itself imports from here.
"""
