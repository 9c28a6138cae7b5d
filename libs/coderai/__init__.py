"""coderai: one OpenAI-compatible endpoint over every machine you own, and a rented GPU when they are not enough."""

__version__ = "0.1.0"
