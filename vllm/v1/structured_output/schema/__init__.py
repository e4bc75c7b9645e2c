"""What a constraint means, before any backend sees it: JSON-Schema normalization
(`normalize.py`) and the exact rewrites it calls, regex parsing and dialects, and the checks
that find what a backend would compile but not honour."""
