"""Test and demo helpers: tiny model builders and the real servers and processes tests start."""
