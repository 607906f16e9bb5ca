"""What the agent shows: the read-only `AgentState`, and the HTTP API over it."""
