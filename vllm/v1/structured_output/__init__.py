"""Structured outputs: grammar backends (backend_*.py, chosen through registry.py), the
engine's grammar manager (manager.py) and each request's constraint state (request.py).

Nothing here imports the engine core or the worker: the front end's constraint checker
lives in the engine package (constraint_checker.py) and the runner's bitmask application
in the worker package (grammar_bitmask.py).
"""
