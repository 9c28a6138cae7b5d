"""coderai engine_worker service."""
