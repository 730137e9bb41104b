"""Pure functional layers: `f(params, x, config) -> y`. Params are dicts of arrays (see `params.py`)."""
