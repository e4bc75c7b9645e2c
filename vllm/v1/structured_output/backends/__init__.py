"""The grammar backends: each module wraps one library behind `base.py`'s interfaces; a new
backend is its module plus one line in vllm/options.py (`GRAMMAR_BACKENDS`)."""
