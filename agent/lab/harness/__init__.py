"""The reference engine and the agent as subprocesses, loopback scenarios and `kvwatch demo`:
for the demo, the tests and the benchmarks; the agent itself never imports this."""
