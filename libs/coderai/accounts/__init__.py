"""Accounts: API keys, rate limits and budgets in Redis, shared by every gateway replica."""
