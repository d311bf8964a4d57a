"""Configuration data every layer of the engine reads, at the bottom of the package: the model's config
(model_config.py) and the compiled shapes a step is padded to (buckets.py)."""
