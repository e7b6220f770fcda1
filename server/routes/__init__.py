"""Thin FastAPI route handlers."""
