"""omni: tokenize anything, feed it to one shared Transformer."""

__version__ = "0.1.0"
