"""Structured outputs, in three rooms (docs/architecture.md section 5):

- `schema/`: what a JSON schema, regex or grammar means, and its rewrites into forms the
  backends enforce exactly; pure Python, no backend library imported at module level.
- `backends/`: one module per grammar library behind the two interfaces of `backends/base.py`,
  chosen by name through `backends/registry.py` (`auto` picks per request).
- the runtime here: the engine's grammar manager (`manager.py`), each request's constraint
  state (`request.py`), the compile lanes and worker pool, the size limits checked before any
  compile, and the bitmask rows of draft positions.

Nothing here imports the engine core or the worker: the front end's constraint checker
lives in the engine package (constraint_checker.py) and the runner's bitmask application
in the worker package (grammar_bitmask.py).
"""
