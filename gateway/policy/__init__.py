"""Who may ask for what: API keys (`keys`), authentication (`auth`) and per-key quotas (`quotas`)."""
