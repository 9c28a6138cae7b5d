"""coderai scheduler service."""
