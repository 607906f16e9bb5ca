"""The agent's configuration: its schema (kvwatch.config.schema) and how it is read
(kvwatch.config.load)."""
