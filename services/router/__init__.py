"""coderai router service."""
