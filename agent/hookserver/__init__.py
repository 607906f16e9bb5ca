"""The engine hook, agent side: the unix socket engines connect to, one connection per
engine, and the registry of the streams they announced."""
