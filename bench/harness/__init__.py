"""The code the benchmarks share with each other and with the tests: docs sections, the two-configuration comparison
through the deployed app, Ray head and Serve app helpers, fault injection, JSON schemas, and the model harness.

The tests import from here; nothing here (nor anywhere in bench/) imports from tests/.
"""
