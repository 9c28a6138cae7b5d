"""coderai pod_broker service."""
