"""The package's metadata is in pyproject.toml; this file lets older pip versions install it in editable mode."""

from setuptools import setup

setup()
