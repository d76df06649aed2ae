"""sparsetrain: sparse training that is faster and smaller than dense."""
__version__ = "0.1.0"
