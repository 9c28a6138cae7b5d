"""Runtime: settings, logging, the bus, service lifecycle and embedded servers. Imported by every service."""
