"""Test configuration: each area registers its fixtures module here."""

pytest_plugins = ["tests.conftest_engine"]
