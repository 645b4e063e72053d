"""The suite's pytest plugins, each with one job; tests/conftest.py registers them."""
