"""The kvwatch agent daemon: the engine-hook server, the join, policy and actions."""
