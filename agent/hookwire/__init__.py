"""The engine hook's wire, shared by both ends: the message codec, the cancel outcome, the
engine-info type and event counters. The engine side is kvwatch.hook, the agent side
kvwatch.hookserver."""
