"""coderai metrics service."""
