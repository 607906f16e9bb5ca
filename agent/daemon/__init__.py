"""`kvwatch run`: the daemon that owns and runs every stage, its preflight checks and its
log rate limit."""
