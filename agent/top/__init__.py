"""`kvwatch top`: a live terminal view of the streams the agent watches.

model: what a frame holds, the filters and the sort; sources: where frames come from (the
daemon's HTTP API, or a collector loaded in-process with --standalone); render: a frame as
rich renderables that fit the terminal's width; keys: single keys in cbreak mode; app: the
loops (live, piped, once).
"""
