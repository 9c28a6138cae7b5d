"""coderai gateway service."""
