"""Helpers the test modules share (conftest.py holds the fixtures and the collection hooks)."""
