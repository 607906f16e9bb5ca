"""Stage 3, policy: the rules that say whether to act on a stalled stream, the decide step
that applies them once per stall episode, and the audit log of every decision."""
