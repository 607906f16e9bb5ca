"""Stage 2, streams: the judge's states, the stall timers, the join with engine requests
(directly or behind a proxy), per-stream timelines and the JSON view of a socket."""
